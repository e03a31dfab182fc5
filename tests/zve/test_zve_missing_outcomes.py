"""A reward call that failed or timed out leaves the response's outcome missing, not wrong: in
the pass-rate history of stages 0, 1 and 5, in the zero-variance predicate (stage 4, metrics),
counted; and the response lengths generated against those trained on."""

import numpy as np
import pytest
from helpers.zve_groups import make_group, prompts

from espo_jax.zve.config import default_zve_config
from espo_jax.zve.groups import (
    ScoredGroup,
    failed_reward_fraction,
    known_outcomes,
    reward_failed,
)
from espo_jax.zve.metrics import length_metrics, step_metrics
from espo_jax.zve.offline import offline_undecided
from espo_jax.zve.online_filter import OnlineFilter, filter_groups
from espo_jax.zve.pipeline import ZVEPipeline
from espo_jax.zve.scheduler import PromptScheduler
from espo_jax.zve.status import ACTIVE, RETIRED

F = None  # a response whose reward call failed or timed out


def group(outcomes, lengths=None, pid="p"):
    """A group as the rollout side records it: a failed response (F) has outcome 0 and reward
    0.0 (the pool's `failed_reward`) and its index in `meta["reward_failed"]`."""
    g = make_group([0 if o is F else o for o in outcomes], lengths, pid=pid)
    g.meta["reward_failed"] = [j for j, o in enumerate(outcomes) if o is F]
    return g


def scored(outcomes, lengths=None):
    g = group(outcomes, lengths)
    return ScoredGroup(g, [0.0 if o is F else float(o) for o in outcomes])


def test_known_outcomes_leave_out_failed_reward_calls():
    g = group([1, 1, 0, F, F])
    assert reward_failed(g).tolist() == [False, False, False, True, True]
    assert known_outcomes(g).tolist() == [1, 1, 0]
    assert known_outcomes(ScoredGroup(g, [1, 1, 0, 0, 0])).tolist() == [1, 1, 0]
    assert known_outcomes(group([F, F])).tolist() == []
    assert known_outcomes(make_group([1, 0])).tolist() == [1, 0]  # none failed
    assert failed_reward_fraction([g, make_group([1, 0, 1])]) == pytest.approx(2 / 8)
    for bad in (2, [0, 0], [5], [True]):  # a count, a repeat, out of range, not an index
        g.meta["reward_failed"] = bad
        with pytest.raises(ValueError, match=r"'p': meta\['reward_failed'\] must list "
                                             r"distinct response indices in \[0, 5\)"):
            reward_failed(g)


def test_stage1_pass_rate_counts_known_outcomes_only():
    cfg = default_zve_config()
    cfg.adaptive.enabled, cfg.adaptive.min_obs, cfg.adaptive.target_zv = True, 2.0, 0.2
    sched = PromptScheduler(prompts(3), cfg, seed=0)
    sched.observe_groups([group([1, 1, 0, F, F], pid="p0")])
    # 2 right of 3 known (not of 5): s = 2, t = 3, p = (2 + .5) / (3 + 1) = .625 (2/5 would
    # give 2.5 / 6 = .417)
    assert (sched.succ[0], sched.trials[0]) == (2.0, 3.0)
    assert sched.pass_rate("p0") == pytest.approx(0.625)
    # 4 right, 4 timed out: p = 4.5 / 5 = .9; .9^15 = .206 > .2, .9^16 = .185: 16 samples.
    # Read as wrong (4 of 8, p = .5) it would be 4 samples (.5^4 * 2 = .125).
    sched.observe_groups([group([1, 1, 1, 1, F, F, F, F], pid="p1")])
    assert sched.pass_rate("p1") == pytest.approx(0.9) and sched.samples_for("p1") == 16
    # every call failed: no evidence, the history is as it was (no decay either)
    sched.observe_groups([group([F, F, F, F], pid="p0")])
    assert (sched.succ[0], sched.trials[0], sched.visits[0]) == (2.0, 3.0, 1)
    assert sched.totals["missing_outcomes"] == 2 + 4 + 4
    with pytest.raises(ValueError, match="'p2' has 2 outcomes but 3 failed flags"):
        sched.observe("p2", [1, 0], failed=[False, False, True])


def test_stage5_streaks_over_known_outcomes():
    cfg = default_zve_config()
    cfg.retire.enabled, cfg.retire.solved_streak, cfg.retire.failed_streak = True, 2, 2
    sched = PromptScheduler(prompts(3), cfg, seed=0)
    # [right, right, timeout] is all right: two in a row retire p0 (read as wrong: mixed,
    # streak 0, never retired); a group with no outcome between them changes nothing
    sched.observe_groups([group([1, 1, F], pid="p0")])
    assert sched.streak[0] == 1
    sched.observe_groups([group([F, F, F], pid="p0")])
    assert sched.streak[0] == 1 and sched.status[0] == ACTIVE
    sched.observe_groups([group([1, F, 1], pid="p0")])
    assert sched.status[0] == RETIRED
    # timeouts are not failures: a prompt whose every call times out is never retired as
    # unsolved, one wrong answer beside timeouts is all wrong
    for _ in range(3):
        sched.observe_groups([group([F, F, F, F], pid="p1")])
    assert sched.status[1] == ACTIVE and sched.streak[1] == 0 and sched.trials[1] == 0.0
    sched.observe_groups([group([0, F], pid="p2"), group([F, 0, F], pid="p2")])
    assert sched.status[2] == RETIRED and sched.streak[2] == -2
    # a re-probe of a retired prompt without any outcome leaves it retired (not revived)
    sched.observe_groups([group([F, F, F, F], pid="p0")])
    assert sched.status[0] == RETIRED and sched.pop_metrics()["zve/revived"] == 0
    sched.observe_groups([group([1, 0, F, F], pid="p0")])  # mixed known outcomes: back
    assert sched.status[0] == ACTIVE


def test_offline_undecided_counts_failed_draws_against_k():
    cfg = default_zve_config().offline
    cfg.k, cfg.low, cfg.high = 4, 0.0, 1.0
    # 2 right of 2 known, 3 of 4 drawn (one failed): 1 left, the rate ends in [2/3, 3/3]: a
    # right 4th prunes (read as wrong, 2 of 3 would already be kept)
    assert offline_undecided(2, 2, cfg, drawn=3)
    assert not offline_undecided(2, 2, cfg, drawn=4)  # all k drawn: 2/2 decides
    assert offline_undecided(0, 0, cfg, drawn=3)  # no outcome yet, 1 left: [0/1, 1/1]
    assert not offline_undecided(1, 2, cfg, drawn=3)  # [1/3, 2/3]: kept whatever comes
    assert offline_undecided(1, 2, cfg) == offline_undecided(1, 2, cfg, drawn=2)
    with pytest.raises(ValueError, match="successes <= samples <= drawn"):
        offline_undecided(1, 3, cfg, drawn=2)


@pytest.mark.parametrize("early_stop", [False, True])
def test_stage0_pass_rates_over_known_outcomes(early_stop):
    # outcome j of prompt i is SCRIPT[i][j] (F: the reward call timed out)
    script = {"a": [1, 1, F, 1, 1], "b": [1, 1, 0, F, F], "c": [F, F, F, F, F],
              "d": [0, F, 0, 0, 0]}
    drawn = dict.fromkeys(script, 0)

    def policy(plan):
        out = []
        for p, n in plan:
            pid, j = p["prompt_id"], drawn[p["prompt_id"]]
            drawn[pid] += n
            out.append(group(script[pid][j:j + n], [10] * n, pid=pid))
        return out

    cfg = default_zve_config()
    cfg.offline.enabled, cfg.offline.k, cfg.offline.early_stop = True, 5, early_stop
    zve = ZVEPipeline([{"prompt_id": pid} for pid in script], cfg, max_len=40)
    pruned, m = zve.offline_prune(policy)
    # a: 4 of 4 known right, rate 1: pruned (read as wrong, 4/5 kept); d: 0 of 4: pruned;
    # b: 2 of 3 known; c: no outcome, no rate: kept, its history unseeded
    assert sorted(pruned) == ["a", "d"]
    sched = zve.scheduler
    b, c = sched._lookup("b"), sched._lookup("c")
    assert (sched.succ[b], sched.trials[b]) == (2.0, 3.0)  # pass rate 2/3, not 2/5
    assert (sched.succ[c], sched.trials[c], sched.status[c]) == (0.0, 0.0, ACTIVE)
    # Early stop: b is undecided until 2 of 2 known after 2 drawn -> [2/5, 5/5]; after its
    # third (wrong) it is 2 of 3 known from 3, rate in [2/5, 4/5]: kept, 2 draws saved. c is
    # drawn to k: with no outcome every rate stays possible.
    assert drawn == {"a": 5, "b": 3 if early_stop else 5, "c": 5, "d": 5}
    assert m["zve/offline_rollouts"] == sum(drawn.values())
    assert m["zve/offline_missing_outcomes"] == 1 + (0 if early_stop else 2) + 5 + 1


def test_zero_variance_predicate_over_known_outcomes():
    # [right, right, timeout] is an all-right zero-variance group; [right, wrong, timeout] has
    # contrast; a group with no outcome has none and is not kept
    assert filter_groups(known_outcomes(group(o)) for o in (
        [1, 1, F], [0, F, 0], [1, 0, F], [F, F], [1, 0])).tolist() == [
        False, False, True, False, True]
    cfg = default_zve_config().online_filter
    cfg.enabled, cfg.max_refill_rounds, cfg.pad_with_filtered = True, 0, False
    batch = [scored([1, 1, F]), scored([0, F]), scored([F, F]), scored([1, 0, F])]
    with pytest.warns(RuntimeWarning, match="1 of 4 groups have outcome variance"):
        result = OnlineFilter(cfg).collect(4, lambda n: batch[:n])
    assert result.batch == [batch[3]]
    # RL-ZVP for all-right groups only (zvp.wrong_groups False): the all-right one is kept,
    # the all-wrong one and the one without outcomes are not
    with pytest.warns(RuntimeWarning):
        result = OnlineFilter(cfg, keep_zero_variance=True, keep_wrong=False).collect(
            4, lambda n: batch[:n])
    assert result.batch == [batch[0], batch[3]]


def test_step_metrics_count_missing_outcomes():
    g0, g1, g3 = scored([1, 1, F]), scored([F, F]), scored([0, 0])
    g2 = scored([1, 0, F, F], lengths=[2, 3, 5, 7])
    m = step_metrics([g0, g1, g2, g3], [g0, g2])
    assert m["zve/missing_outcomes"] == 1 + 2 + 2 and m["zve/missing_outcome_groups"] == 1
    # the failed responses are not trained tokens: g2's 2 + 3 of its 17, g0's two of three
    assert m["zve/trained_tokens"] == sum(g0.lengths[:2]) + 2 + 3
    # by known outcome g0 (all right) and g3 (all wrong) of the 3 groups with an outcome
    assert m["zve/zero_variance_frac_before"] == pytest.approx(2 / 3)
    assert m["zve/zero_variance_frac_batch_outcome"] == pytest.approx(1 / 2)  # g0 of g0, g2
    assert step_metrics([g0], [g0])["zve/missing_outcome_groups"] == 0


def test_length_metrics_show_a_filter_that_drops_long_groups():
    # informative groups are short (2 and 4 tokens), all-right ones long (10 and 30): the
    # filter keeps the short ones
    short, long = ([1, 0], [2, 4]), ([1, 1], [10, 30])
    cfg = default_zve_config().online_filter
    cfg.enabled, cfg.max_refill_rounds, cfg.pad_with_filtered = True, 0, False
    made = [scored(*short), scored(*long), scored(*short)]
    result = OnlineFilter(cfg).collect(2, lambda n: made[:n])  # asks 2 * 1.5 = 3
    assert result.batch == [made[0], made[2]]
    m = length_metrics(result.generated, result.batch)
    # generated 2 4 10 30 2 4: mean 52/6; p90 at 0.9 * 5 = 4.5 of sorted 2 2 4 4 10 30:
    # 10 + .5 * 20 = 20. trained 2 4 2 4: mean 3, p90 at 2.7 of 2 2 4 4: 4
    assert m == pytest.approx({"lengths/generated_mean": 52 / 6, "lengths/generated_p90": 20.0,
                               "lengths/trained_mean": 3.0, "lengths/trained_p90": 4.0})
    assert m["lengths/trained_mean"] < m["lengths/generated_mean"]
    # stale groups dropped before MS-ZVE saw them count as generated: + 50 50: mean 152/8,
    # p90 at 6.3 of 2 2 4 4 10 30 50 50: 50
    m = length_metrics(result.generated, result.batch, dropped_lengths=[50, 50])
    assert m["lengths/generated_mean"] == pytest.approx(19.0)
    assert m["lengths/generated_p90"] == pytest.approx(50.0)
    assert set(length_metrics([], []).values()) == {0.0}


def test_pipeline_step_logs_lengths_and_missing_outcomes():
    cfg = default_zve_config()
    cfg.n_samples = 2
    cfg.online_filter.enabled, cfg.online_filter.max_refill_rounds = True, 0
    cfg.online_filter.pad_with_filtered = False
    shapes = {"p0": ([1, 0], [2, 4]), "p1": ([1, 1], [10, 30]), "p2": ([1, F], [6, 6])}

    def rollout(plan):
        return [group(*shapes[p["prompt_id"]], pid=p["prompt_id"]) for p, _ in plan]

    zve = ZVEPipeline(prompts(3), cfg, seed=0, max_len=40)
    with pytest.warns(RuntimeWarning, match="1 of 2 groups"):
        batch, m = zve.step(2, rollout)  # asks for 3: one epoch, every prompt once
    assert [s.prompt_id for s in batch] == ["p0"]  # p1 and p2 ([1, timeout]) are all right
    assert m["lengths/generated_mean"] == pytest.approx(58 / 6)
    assert m["lengths/trained_mean"] == 3.0 and m["zve/missing_outcomes"] == 1.0
    assert zve.scheduler.trials == [2.0, 2.0, 1.0]  # p2: one known outcome of 2
    np.testing.assert_array_equal(batch[0].rewards, [1.0, 0.0])


def test_length_metrics_leave_failed_responses_out_of_the_trained():
    """A response whose reward failed is in the batch (packed like the others) but its loss
    mask is 0: `lengths/trained_*` counts only the responses the loss trains on."""
    g = scored([1, F, 0, F], [2, 40, 6, 50])
    m = length_metrics([g], [g])
    # generated 2 40 6 50: mean 24.5; trained 2 6: mean 4, p90 at 0.9 of [2, 6]: 2 + 0.9 * 4
    assert (m["lengths/generated_mean"], m["lengths/trained_mean"]) == (24.5, 4.0)
    assert m["lengths/trained_p90"] == pytest.approx(5.6)
