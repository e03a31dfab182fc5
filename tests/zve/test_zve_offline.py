"""MS-ZVE stage 0: offline pruning, its early stop, and the pass around a rollout callback."""

import pytest
from helpers.zve_groups import ids, make_group, prompts

from espo_jax.zve.config import default_zve_config
from espo_jax.zve.offline import offline_undecided
from espo_jax.zve.pipeline import ZVEPipeline
from espo_jax.zve.scheduler import PromptScheduler


def test_stage0_offline_pruning():
    cfg = default_zve_config()
    sched = PromptScheduler(prompts(4), cfg, seed=0)
    assert sched.offline_prune({"p0": 0.0}) == []  # disabled: a no-op
    cfg.offline.enabled = True
    sched = PromptScheduler(prompts(4), cfg, seed=0)
    plan = sched.offline_plan()
    assert [(p["prompt_id"], k) for p, k in plan] == [(f"p{i}", 8) for i in range(4)]
    pruned = sched.offline_prune({"p0": 0.0, "p1": 1.0, "p2": 0.5, "p3": 0.125})
    assert pruned == ["p0", "p1"]
    assert sorted(ids(sched.next_prompts(2))) == ["p2", "p3"]  # one epoch: the survivors
    # the estimate seeds stage 1's history: p3 = 1 of 8 -> (1 + .5) / (8 + 1)
    assert sched.pass_rate("p3") == pytest.approx(1.5 / 9)
    assert sched.pop_metrics()["zve/pruned"] == 2
    with pytest.raises(ValueError, match="not in \\[0, 1\\]"):
        sched.offline_prune({"p2": 1.5})
    with pytest.raises(KeyError, match="unknown prompt_id 'nope'"):
        sched.offline_prune({"nope": 0.5})


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


def test_offline_early_stop_keeps_the_decisions_and_saves_samples():
    # outcome j of prompt i is SCRIPT[i][j]: the same samples with and without the early stop
    script = {"a": [1, 1, 1, 1], "b": [0, 0, 0, 0], "c": [1, 0, 1, 1], "d": [0, 0, 0, 1],
              "e": [1, 1, 1, 0]}
    prompts = [{"prompt_id": pid} for pid in script]

    def run(early_stop, low):
        drawn = dict.fromkeys(script, 0)

        def policy(plan):
            out = []
            for p, n in plan:
                pid, j = p["prompt_id"], drawn[p["prompt_id"]]
                drawn[pid] += n
                out.append(make_group(script[pid][j:j + n], [10] * n, pid=pid))
            return out

        cfg = default_zve_config()
        cfg.offline.enabled, cfg.offline.k, cfg.offline.low = True, 4, low
        cfg.offline.early_stop = early_stop
        zve = ZVEPipeline(prompts, cfg, max_len=40)
        pruned, m = zve.offline_prune(policy)
        return sorted(pruned), drawn, m, zve

    full_pruned, full_drawn, full_m, _ = run(False, 0.0)
    assert full_pruned == ["a", "b"] and full_m["zve/offline_rollouts"] == 20
    pruned, drawn, m, zve = run(True, 0.0)
    # a, b can be pruned until the end; c is mixed after 2, d after 4, e after 4
    assert pruned == full_pruned and drawn == {"a": 4, "b": 4, "c": 2, "d": 4, "e": 4}
    assert m["zve/offline_rollouts"] == 18 and m["zve/offline_tokens"] == 180
    # stage 1's history holds what was drawn: c at 1 right of 2
    assert zve.scheduler.trials[zve.scheduler._lookup("c")] == 2.0
    assert zve.scheduler.pass_rate("c") == 0.5
    # low < 0 (only always-solved prompts are pruned): the first wrong outcome settles a prompt
    pruned, drawn, _, _ = run(True, -1.0)
    assert pruned == ["a"] and drawn == {"a": 4, "b": 1, "c": 2, "d": 1, "e": 4}
