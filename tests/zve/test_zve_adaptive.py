"""MS-ZVE stage 1: sample counts from pass-rate estimates, settled prompts skipped."""

import pytest
from helpers.zve_groups import ids, prompts

from espo_jax.zve.adaptive import adaptive_samples, zero_variance_prob
from espo_jax.zve.config import default_zve_config
from espo_jax.zve.scheduler import PromptScheduler


def test_adaptive_samples_by_hand():
    a = default_zve_config().adaptive  # min 4, max 16, multiple 4
    a.target_zv = 0.2
    assert zero_variance_prob(0.5, 4) == 0.125  # 2 * 0.5^4
    assert adaptive_samples(0.5, a) == 4  # n = 4 (min) already gives 0.125
    # p = 0.7: n=4 gives .7^4 + .3^4 = .2482 > .2; n=5 gives .1681 + .0024 = .1705 -> 5 -> 8
    assert adaptive_samples(0.7, a) == 8
    # p = 0.9: n=15 gives .2059; n=16 gives .1853 -> 16
    assert adaptive_samples(0.9, a) == 16
    assert adaptive_samples(0.1, a) == 16  # symmetric
    # p = 0.95: even .95^16 = .44 > .2: settled -> settled_samples (0: skipped)
    assert adaptive_samples(0.95, a) == 0


def test_stage1_skips_settled_prompts_until_their_evidence_ages():
    cfg = default_zve_config()
    cfg.adaptive.enabled = True
    cfg.adaptive.target_zv = 0.2
    sched = PromptScheduler(prompts(3), cfg, seed=0)
    sched.observe("p0", [1, 0, 1, 0, 1, 0, 1, 0])  # 4/8: p = 4.5/9 = .5 -> 4 samples
    sched.observe("p1", [1] * 8)  # 8/8: p = 8.5/9 = .944 -> settled
    assert sched.samples_for("p0") == 4 and sched.samples_for("p1") == 0
    assert sched.samples_for("p2") == 8  # no history (< min_obs): n_samples
    # epoch 0 and 1 skip p1 (t: 8 -> 5.6 -> 3.92; at 5.6 p = 6.1/6.6 = .924, .924^16 = .28
    # > .2, still settled); at 3.92 < min_obs = 4 the estimate is no longer trusted: 8 samples
    drawn = sched.next_prompts(7)
    assert sorted(ids(drawn)) == ["p0"] * 3 + ["p1"] + ["p2"] * 3
    assert {n for p, n in drawn if p["prompt_id"] == "p0"} == {4}
    assert [n for p, n in drawn if p["prompt_id"] == "p1"] == [8]
    m = sched.pop_metrics()
    assert m["zve/skipped_settled"] == 2
    assert m["zve/samples_per_prompt"] == pytest.approx((3 * 4 + 8 + 3 * 8) / 7)
