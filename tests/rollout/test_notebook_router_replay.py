"""notebooks/router_replay.ipynb is stored with its outputs (the per-token plot, the mismatch
table) and runs top to bottom (kernel python3), printing the stored numbers: the engine's
samples are a function of its seeds, so the mismatch figures repeat."""

import pathlib

import nbformat
import numpy as np
from helpers import notebooks

NOTEBOOK = pathlib.Path(__file__).parents[2] / "notebooks" / "router_replay.ipynb"


def test_router_replay_notebook_is_stored_with_outputs_and_reruns_the_same(monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend: PNG outputs
    stored = nbformat.read(NOTEBOOK, as_version=4)
    sizes = notebooks.png_sizes(stored)
    assert len(sizes) == 1 and 0 < sizes[0] < 100_000, sizes
    assert not notebooks.errors(stored)
    text = "".join(notebooks.printed(stored))
    # 8 prompts x 2 samples; 6 prompt tokens + 16 new ones, 2 MoE layers, top-2 routing.
    assert "16 responses from the jax-fp8 engine" in text and "= (22, 2, 2)" in text
    assert "routing flip rate, MoE layer 1" in text
    assert "replay cuts the gap at tokens after a flip by" in text

    ran = notebooks.execute(NOTEBOOK, timeout=300)  # its own asserts hold, or this raises
    assert not notebooks.errors(ran) and len(notebooks.png_sizes(ran)) == 1
    for new, old in zip(notebooks.printed(ran), notebooks.printed(stored), strict=True):
        # The same text around the numbers (labels, shapes), and the numbers as printed.
        assert notebooks.NUMBER.sub("#", new) == notebooks.NUMBER.sub("#", old)
        np.testing.assert_allclose(notebooks.numbers(new), notebooks.numbers(old), rtol=1e-3)
