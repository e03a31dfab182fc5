"""notebooks/espo_losses.ipynb runs top to bottom in this interpreter's kernel."""

import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).parents[2] / "notebooks" / "espo_losses.ipynb"


def test_espo_losses_notebook_executes(monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # no display; the kernel inherits the environment
    nb = nbformat.read(NOTEBOOK, as_version=4)
    n_cells = len(nb.cells)
    # Appended (not saved): report which interpreter ran the kernel.
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    # kernel "python3" is launched with the running interpreter when ipykernel is installed in it.
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError if any cell fails
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
    outputs = "".join(
        o.get("text", "") for c in nb.cells[:n_cells] if c.cell_type == "code" for o in c.outputs
    )
    assert "ESPO clips exactly at 1 + alpha * H / log|V|" in outputs
    assert "matches GSPO's 4e-4 at H = 0.239 nats" in outputs
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "error"
    ]
    assert not errors


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
