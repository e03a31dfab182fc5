"""notebooks/router_replay.ipynb runs top to bottom (kernel python3) and shows replay working."""

import pathlib

import jax
import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).parents[2] / "notebooks" / "router_replay.ipynb"


def test_router_replay_notebook_executes(monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # no display; the kernel inherits the environment
    # The kernel shares the tests' persistent compilation cache: the notebook's engine and
    # mismatch shapes are those of tests/rollout/test_engine.py.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError if any cell (including its asserts) fails
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "responses from the jax-fp8 engine" in outputs
    assert "routing flip rate, MoE layer 1" in outputs
    assert "replay cuts the gap at tokens after a flip by" in outputs
