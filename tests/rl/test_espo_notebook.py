"""notebooks/espo_losses.ipynb is stored with its outputs (three plots, the printed clip ranges)
and runs top to bottom in this interpreter's kernel, printing exactly what is stored (every
number in it is a closed-form function of the loss configs)."""

import math
import pathlib
import sys

import nbformat
from helpers import notebooks

NOTEBOOK = pathlib.Path(__file__).parents[2] / "notebooks" / "espo_losses.ipynb"


def test_espo_losses_notebook_is_stored_with_outputs_and_reruns_the_same(monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend: PNG outputs
    stored = nbformat.read(NOTEBOOK, as_version=4)
    sizes = notebooks.png_sizes(stored)
    assert len(sizes) == 3 and all(0 < s < 100_000 for s in sizes), sizes
    assert not notebooks.errors(stored)
    text = "".join(notebooks.printed(stored))
    # eps = alpha * H / log|V| (alpha 0.02, |V| 151936); GSPO's 4e-4 at H = 4e-4 log|V| / alpha.
    eps = [0.02 * h / math.log(151936) for h in (0.1, 3.0)]
    assert f"ESPO eps at H=0.1: {eps[0]:.2e}; at H=3.0: {eps[1]:.2e}" in text
    assert f"matches GSPO's 4e-4 at H = {4e-4 * math.log(151936) / 0.02:.3f} nats" in text
    assert "ESPO clips exactly at 1 + alpha * H / log|V|" in text

    ran = notebooks.execute(NOTEBOOK, timeout=120, append=("import sys; print(sys.executable)",))
    assert notebooks.printed(ran)[-1].strip() == sys.executable  # this interpreter's kernel
    assert not notebooks.errors(ran) and len(notebooks.png_sizes(ran)) == 3
    assert notebooks.printed(ran)[:-1] == notebooks.printed(stored)
