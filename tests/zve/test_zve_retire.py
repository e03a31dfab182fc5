"""MS-ZVE stage 5: retirement after equal streaks, re-probes, the per-epoch probe credit."""

from helpers.zve_groups import ids, prompts

from espo_jax.zve.config import default_zve_config
from espo_jax.zve.retire import next_streak, outcome_sign
from espo_jax.zve.scheduler import PromptScheduler


def _retire_cfg():
    cfg = default_zve_config()
    cfg.retire.enabled = True
    cfg.retire.solved_streak = 2
    cfg.retire.failed_streak = 3
    cfg.retire.reprobe_every = 2
    cfg.retire.reprobe_samples = 4
    cfg.retire.reprobe_frac = 1.0  # every due prompt, up to one per active prompt
    return cfg


def test_streaks_by_hand():
    assert [outcome_sign(3, 3), outcome_sign(0, 3), outcome_sign(1, 3)] == [1, -1, 0]
    assert [next_streak(2, 1), next_streak(2, -1), next_streak(-2, -1), next_streak(5, 0),
            next_streak(0, 1)] == [3, -1, -3, 0, 1]


def test_stage5_retires_and_a_reprobe_brings_a_prompt_back():
    sched = PromptScheduler(prompts(3), _retire_cfg(), seed=0)
    for _ in range(2):  # epochs 0 and 1: p0 solved twice -> retired at epoch 1
        assert sorted(ids(sched.next_prompts(3))) == ["p0", "p1", "p2"]
        sched.observe("p0", [1] * 8)
        sched.observe("p1", [1, 0] * 4)
        sched.observe("p2", [1, 0] * 4)
    m = sched.pop_metrics()
    assert m["zve/retired"] == 1 and m["zve/retired_new"] == 1
    assert sorted(ids(sched.next_prompts(2))) == ["p1", "p2"]  # epoch 2: p0 is out
    epoch3 = sched.next_prompts(3)  # epoch 3 = 1 + reprobe_every: p0 probed with 4 samples
    assert sorted((p["prompt_id"], n) for p, n in epoch3) == [("p0", 4), ("p1", 8), ("p2", 8)]
    assert sched.pop_metrics()["zve/reprobed"] == 1
    sched.observe("p0", [1, 1, 0, 1])  # mixed: back in
    m = sched.pop_metrics()
    assert m["zve/revived"] == 1 and m["zve/retired"] == 0
    assert sorted(ids(sched.next_prompts(3))) == ["p0", "p1", "p2"]  # epoch 4


def test_stage5_failed_streak_and_a_probe_that_stays_settled():
    sched = PromptScheduler(prompts(2), _retire_cfg(), seed=0)
    for _ in range(3):  # p1 wrong 3 visits in a row -> retired at epoch 2
        sched.next_prompts(2)
        sched.observe("p0", [1, 0])
        sched.observe("p1", [0, 0])
    assert sched.status[1] == "retired" and sched.next_probe[1] == 4
    assert ids(sched.next_prompts(1)) == ["p0"]  # epoch 3
    assert sorted(ids(sched.next_prompts(2))) == ["p0", "p1"]  # epoch 4: probe
    sched.observe("p1", [0, 0, 0, 0])  # still failing: stays retired, next probe at 4 + 2
    assert sched.status[1] == "retired" and sched.next_probe[1] == 6
    assert ids(sched.next_prompts(1)) == ["p0"]  # epoch 5
    assert sorted(ids(sched.next_prompts(2))) == ["p0", "p1"]  # epoch 6: probed again


def test_reprobes_per_epoch_follow_the_credit():
    cfg = _retire_cfg()
    cfg.retire.solved_streak = 1
    cfg.retire.reprobe_every = 1
    cfg.retire.reprobe_frac = 0.25
    sched = PromptScheduler(prompts(6), cfg, seed=0)
    sched.next_prompts(6)  # epoch 0
    for i in range(6):  # p0..p3 solved (retired, streak 1), p4, p5 mixed
        sched.observe(f"p{i}", [1, 1] if i < 4 else [1, 0])
    # 2 active prompts x .25 = .5 probe credit per epoch: epochs alternate 0 and 1 probes, and
    # the longest-waiting prompt goes first (all due since epoch 1: lowest index, then p1, ...)
    probed = []
    for expected_len in (2, 3, 2, 3, 2, 3):
        drawn = sched.next_prompts(expected_len)
        assert sorted(ids(drawn))[-2:] == ["p4", "p5"]
        probed += [p["prompt_id"] for p, _ in drawn if p["prompt_id"] not in ("p4", "p5")]
        for p, n in drawn:
            sched.observe(p["prompt_id"], [1] * n if p["prompt_id"] in probed else [1, 0])
        assert sched.cursor == len(sched.order)  # the epoch is exactly that long
    assert probed == ["p0", "p1", "p2"]
