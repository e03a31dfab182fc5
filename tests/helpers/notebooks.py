"""The notebooks of notebooks/ are stored executed, with their outputs (plots, printed numbers):
run one as stored, and compare a fresh run's outputs with the stored ones.

    PYTHONPATH=. python tests/helpers/notebooks.py notebooks/NAME.ipynb   # executes, stores outputs

(the same as `jupyter execute --inplace`, less the per-cell timing metadata). The kernel is
"python3" in this interpreter and inherits the environment (PYTHONPATH, the JAX cache).
"""

from __future__ import annotations

import base64
import os
import re
import sys

import nbformat
from nbclient import NotebookClient

# A number as printed: 0.745, 3.70e-03, 16, -1.2, 5.7 of "5.7x" (not inside a word: "layer_0").
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?=x\b|[^\w.]|$)")


def execute(path: str | os.PathLike, timeout: int = 300, append: tuple[str, ...] = ()
            ) -> nbformat.NotebookNode:
    """The notebook at `path` (plus code cells `append`) run top to bottom in a python3 kernel
    started in its folder; raises `nbclient.exceptions.CellExecutionError` if a cell fails."""
    nb = nbformat.read(path, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(source) for source in append]
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}}
                   ).execute()
    return nb


def printed(nb: nbformat.NotebookNode) -> list[str]:
    """The printed text (stdout streams) of each code cell, in order."""
    return ["".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream")
            for c in nb.cells if c.cell_type == "code"]


def numbers(text: str) -> list[float]:
    return [float(m) for m in NUMBER.findall(text)]


def png_sizes(nb: nbformat.NotebookNode) -> list[int]:
    """The size in bytes of every PNG image among the outputs."""
    return [len(base64.b64decode(o["data"]["image/png"])) for c in nb.cells
            if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]


def errors(nb: nbformat.NotebookNode) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.get("output_type") == "error"]


if __name__ == "__main__":
    for name in sys.argv[1:]:
        nbformat.write(execute(name), name)
        print(f"{name}: executed, outputs stored")
