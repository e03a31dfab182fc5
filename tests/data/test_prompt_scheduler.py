"""PromptScheduler: MS-ZVE stages 0, 1, 5 on hand-built histories; state save/restore."""

import json

import numpy as np
import pytest

from espo_jax.data.prompt_scheduler import (
    PromptScheduler,
    adaptive_samples,
    offline_undecided,
    zero_variance_prob,
)
from espo_jax.data.zve_config import default_zve_config, validate_zve_config


def _prompts(n):
    return [{"prompt_id": f"p{i}", "prompt": f"{i}+1="} for i in range(n)]


def _ids(drawn):
    return [p["prompt_id"] for p, _ in drawn]


def test_all_stages_off_is_plain_epochs():
    cfg = default_zve_config()
    sched = PromptScheduler(_prompts(5), cfg, seed=1)
    first, second = sched.next_prompts(5), sched.next_prompts(5)
    assert sorted(_ids(first)) == sorted(_ids(second)) == [f"p{i}" for i in range(5)]
    assert {n for _, n in first + second} == {8}  # n_samples
    # deterministic given the seed; another seed gives another order
    again = PromptScheduler(_prompts(5), cfg, seed=1)
    assert _ids(again.next_prompts(10)) == _ids(first + second)
    orders = {tuple(_ids(PromptScheduler(_prompts(5), cfg, seed=s).next_prompts(5)))
              for s in range(4)}
    assert len(orders) > 1
    sched.observe("p0", [1, 1, 1, 1, 1, 1, 1, 1])  # retire off: an all-right group changes nothing
    assert sorted(_ids(sched.next_prompts(5))) == [f"p{i}" for i in range(5)]


def test_stage0_offline_pruning():
    cfg = default_zve_config()
    sched = PromptScheduler(_prompts(4), cfg, seed=0)
    assert sched.offline_prune({"p0": 0.0}) == []  # disabled: a no-op
    cfg.offline.enabled = True
    sched = PromptScheduler(_prompts(4), cfg, seed=0)
    plan = sched.offline_plan()
    assert [(p["prompt_id"], k) for p, k in plan] == [(f"p{i}", 8) for i in range(4)]
    pruned = sched.offline_prune({"p0": 0.0, "p1": 1.0, "p2": 0.5, "p3": 0.125})
    assert pruned == ["p0", "p1"]
    assert sorted(_ids(sched.next_prompts(2))) == ["p2", "p3"]  # one epoch: the survivors
    # the estimate seeds stage 1's history: p3 = 1 of 8 -> (1 + .5) / (8 + 1)
    assert sched.pass_rate("p3") == pytest.approx(1.5 / 9)
    assert sched.pop_metrics()["zve/pruned"] == 2
    with pytest.raises(ValueError, match="not in \\[0, 1\\]"):
        sched.offline_prune({"p2": 1.5})
    with pytest.raises(KeyError, match="unknown prompt_id 'nope'"):
        sched.offline_prune({"nope": 0.5})


def test_nothing_left_is_an_error_not_a_hang():
    cfg = default_zve_config()
    cfg.offline.enabled = True
    sched = PromptScheduler(_prompts(2), cfg, seed=0)
    sched.offline_prune({"p0": 0.0, "p1": 1.0})
    with pytest.raises(RuntimeError, match="nothing to sample.*'pruned': 2"):
        sched.next_prompts(1)


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
    sched = PromptScheduler(_prompts(3), cfg, seed=0)
    sched.observe("p0", [1, 0, 1, 0, 1, 0, 1, 0])  # 4/8: p = 4.5/9 = .5 -> 4 samples
    sched.observe("p1", [1] * 8)  # 8/8: p = 8.5/9 = .944 -> settled
    assert sched.samples_for("p0") == 4 and sched.samples_for("p1") == 0
    assert sched.samples_for("p2") == 8  # no history (< min_obs): n_samples
    # epoch 0 and 1 skip p1 (t: 8 -> 5.6 -> 3.92; at 5.6 p = 6.1/6.6 = .924, .924^16 = .28
    # > .2, still settled); at 3.92 < min_obs = 4 the estimate is no longer trusted: 8 samples
    drawn = sched.next_prompts(7)
    assert sorted(_ids(drawn)) == ["p0"] * 3 + ["p1"] + ["p2"] * 3
    assert {n for p, n in drawn if p["prompt_id"] == "p0"} == {4}
    assert [n for p, n in drawn if p["prompt_id"] == "p1"] == [8]
    m = sched.pop_metrics()
    assert m["zve/skipped_settled"] == 2
    assert m["zve/samples_per_prompt"] == pytest.approx((3 * 4 + 8 + 3 * 8) / 7)


def _retire_cfg():
    cfg = default_zve_config()
    cfg.retire.enabled = True
    cfg.retire.solved_streak = 2
    cfg.retire.failed_streak = 3
    cfg.retire.reprobe_every = 2
    cfg.retire.reprobe_samples = 4
    cfg.retire.reprobe_frac = 1.0  # every due prompt, up to one per active prompt
    return cfg


def test_stage5_retires_and_a_reprobe_brings_a_prompt_back():
    sched = PromptScheduler(_prompts(3), _retire_cfg(), seed=0)
    for _ in range(2):  # epochs 0 and 1: p0 solved twice -> retired at epoch 1
        assert sorted(_ids(sched.next_prompts(3))) == ["p0", "p1", "p2"]
        sched.observe("p0", [1] * 8)
        sched.observe("p1", [1, 0] * 4)
        sched.observe("p2", [1, 0] * 4)
    m = sched.pop_metrics()
    assert m["zve/retired"] == 1 and m["zve/retired_new"] == 1
    assert sorted(_ids(sched.next_prompts(2))) == ["p1", "p2"]  # epoch 2: p0 is out
    epoch3 = sched.next_prompts(3)  # epoch 3 = 1 + reprobe_every: p0 probed with 4 samples
    assert sorted((p["prompt_id"], n) for p, n in epoch3) == [("p0", 4), ("p1", 8), ("p2", 8)]
    assert sched.pop_metrics()["zve/reprobed"] == 1
    sched.observe("p0", [1, 1, 0, 1])  # mixed: back in
    m = sched.pop_metrics()
    assert m["zve/revived"] == 1 and m["zve/retired"] == 0
    assert sorted(_ids(sched.next_prompts(3))) == ["p0", "p1", "p2"]  # epoch 4


def test_stage5_failed_streak_and_a_probe_that_stays_settled():
    sched = PromptScheduler(_prompts(2), _retire_cfg(), seed=0)
    for _ in range(3):  # p1 wrong 3 visits in a row -> retired at epoch 2
        sched.next_prompts(2)
        sched.observe("p0", [1, 0])
        sched.observe("p1", [0, 0])
    assert sched.status[1] == "retired" and sched.next_probe[1] == 4
    assert _ids(sched.next_prompts(1)) == ["p0"]  # epoch 3
    assert sorted(_ids(sched.next_prompts(2))) == ["p0", "p1"]  # epoch 4: probe
    sched.observe("p1", [0, 0, 0, 0])  # still failing: stays retired, next probe at 4 + 2
    assert sched.status[1] == "retired" and sched.next_probe[1] == 6
    assert _ids(sched.next_prompts(1)) == ["p0"]  # epoch 5
    assert sorted(_ids(sched.next_prompts(2))) == ["p0", "p1"]  # epoch 6: probed again


def test_reprobes_per_epoch_follow_the_credit():
    cfg = _retire_cfg()
    cfg.retire.solved_streak = 1
    cfg.retire.reprobe_every = 1
    cfg.retire.reprobe_frac = 0.25
    sched = PromptScheduler(_prompts(6), cfg, seed=0)
    sched.next_prompts(6)  # epoch 0
    for i in range(6):  # p0..p3 solved (retired, streak 1), p4, p5 mixed
        sched.observe(f"p{i}", [1, 1] if i < 4 else [1, 0])
    # 2 active prompts x .25 = .5 probe credit per epoch: epochs alternate 0 and 1 probes, and
    # the longest-waiting prompt goes first (all due since epoch 1: lowest index, then p1, ...)
    probed = []
    for expected_len in (2, 3, 2, 3, 2, 3):
        drawn = sched.next_prompts(expected_len)
        assert sorted(_ids(drawn))[-2:] == ["p4", "p5"]
        probed += [p["prompt_id"] for p, _ in drawn if p["prompt_id"] not in ("p4", "p5")]
        for p, n in drawn:
            sched.observe(p["prompt_id"], [1] * n if p["prompt_id"] in probed else [1, 0])
        assert sched.cursor == len(sched.order)  # the epoch is exactly that long
    assert probed == ["p0", "p1", "p2"]


def test_outcomes_must_be_binary():
    sched = PromptScheduler(_prompts(1), default_zve_config())
    with pytest.raises(ValueError, match="binary 0/1.*never a shaped reward"):
        sched.observe("p0", [1.1, 0.0])
    with pytest.raises(ValueError, match="2 outcomes but 3 lengths"):
        sched.observe("p0", [1, 0], [3, 4, 5])


def _simulate(sched, steps, prompts_per_step=3):
    """Drives the scheduler with outcomes that depend only on (prompt, visit): deterministic."""
    log = []
    for _ in range(steps):
        for p, n in sched.next_prompts(prompts_per_step):
            i = int(p["prompt_id"][1:])
            visit = sched.visits[i]
            rng = np.random.default_rng([i, visit])
            rate = [0.0, 1.0, 0.5, 0.9, 0.2, 1.0][i % 6]
            outcomes = (rng.random(n) < rate).astype(int).tolist()
            sched.observe(p["prompt_id"], outcomes, [5] * n)
            log.append((p["prompt_id"], n, tuple(outcomes)))
        log.append(tuple(sorted(sched.pop_metrics().items())))
    return log


def test_state_round_trip_continues_identically():
    cfg = default_zve_config()
    cfg.adaptive.enabled = True
    cfg.retire.enabled = True
    cfg.retire.solved_streak = cfg.retire.failed_streak = 2
    prompts = _prompts(12)
    original = PromptScheduler(prompts, cfg, seed=7)
    _simulate(original, 9)  # mid-epoch (12 prompts, 3 per step), some retired by now
    assert original.status.count("retired") > 0
    state = json.loads(json.dumps(original.state_dict()))  # JSON round trip
    restored = PromptScheduler.from_state_dict(state, prompts, cfg)
    assert _simulate(restored, 12) == _simulate(original, 12)
    assert restored.state_dict() == original.state_dict()
    with pytest.raises(ValueError, match="different prompt list"):
        PromptScheduler.from_state_dict(state, prompts[::-1], cfg)


def test_config_validation_names_the_field():
    cfg = default_zve_config()
    validate_zve_config(cfg)
    cfg.tie_break.prefer = "cheaper"
    with pytest.raises(ValueError, match="'cheaper' is not one of \\('shorter', 'longer'\\)"):
        PromptScheduler(_prompts(1), cfg)
    cfg = default_zve_config()
    cfg.adaptive.min_samples = 20
    with pytest.raises(ValueError, match="min_samples <= max_samples, got 20, 16"):
        validate_zve_config(cfg)
    with pytest.raises(ValueError, match="'p0' appears more than once"):
        PromptScheduler(_prompts(1) * 2, default_zve_config())


def test_offline_undecided_by_hand():
    cfg = default_zve_config().offline
    cfg.k, cfg.low, cfg.high = 4, 0.0, 1.0
    assert offline_undecided(0, 0, cfg)  # nothing drawn: anything is possible
    assert offline_undecided(3, 3, cfg)  # 3 of 3 right: a 4th right prunes at rate 1
    assert not offline_undecided(1, 2, cfg)  # 1 of 2: the rate ends in [1/4, 3/4], kept
    assert not offline_undecided(0, 4, cfg)  # all k drawn
    cfg.low = 0.25  # prune at <= 1 right of 4
    assert offline_undecided(1, 2, cfg)  # 1 of 2 may end at 1/4
    assert offline_undecided(2, 2, cfg)  # 2 of 2 may still end at 4 of 4
    assert not offline_undecided(2, 3, cfg)  # ends at 2/4 or 3/4
