"""The console's progress bar, and the share of RL it shows when a token budget ends RL."""

import io
import types

import ml_collections

from espo_jax import console
from espo_jax.train import run


def test_progress_follows_the_share_it_is_given():
    out = io.StringIO()  # not a terminal: a line at every tenth of the way, and at the end
    bar = console.Progress("RL", 120, stream=out)
    bar.update(1, {"acc": 0.5}, frac=0.25)  # step 1 of 120, a quarter of the budget spent
    bar.update(2, frac=0.26)  # same tenth: no new line
    bar.update(4, frac=1.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("RL         [######..................] 1/120")
    assert "eta" in lines[0] and "acc 0.5" in lines[0]
    assert lines[1].startswith("RL         [########################] 4/120")
    assert "eta" not in lines[1]


def _run(steps, max_tokens):
    config = ml_collections.ConfigDict({"train": {"steps": steps, "max_tokens": max_tokens}})
    return types.SimpleNamespace(config=config)


def test_share_done_is_of_steps_or_of_the_budget_left_after_the_offline_pass():
    meta = {"generated_tokens": 30_000, "offline_tokens": 100_000}
    # no budget: steps only
    assert run.Run.share_done(_run(120, 0), 6, meta) == 6 / 120
    # 260k budget, 100k spent offline before RL: 30k of the 160k left
    assert run.Run.share_done(_run(120, 260_000), 6, meta) == 30_000 / 160_000
    # the steps further along than the tokens
    assert run.Run.share_done(_run(8, 260_000), 6, meta) == 6 / 8
    # the offline pass alone spent the budget
    assert run.Run.share_done(_run(120, 90_000), 0, meta) == 1.0
    meta["generated_tokens"] = 160_000
    assert run.Run.finished(_run(120, 260_000), 1, meta)
    assert run.Run.share_done(_run(120, 260_000), 1, meta) == 1.0
