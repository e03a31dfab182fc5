"""ScoredGroup: a RolloutGroup beside its rewards (read-only), outcomes checked binary; unscored
groups named (`require_scored`); the share of failed reward calls."""

import numpy as np
import pytest
from helpers.zve_groups import make_group

from espo_jax.zve.groups import (
    ScoredGroup,
    UnscoredGroupError,
    binary_outcomes,
    failed_reward_fraction,
    groups_and_rewards,
    require_scored,
)


def test_scored_group_reads_the_group_and_keeps_rewards_apart():
    g = make_group([1, 0, 1], [3, 5, 2], pid="q")
    s = ScoredGroup(g, np.array([1.2, 0.0, 1.1], np.float32))
    assert s.prompt_id == "q" and s.outcomes.tolist() == [1, 0, 1]
    assert s.outcomes.dtype == np.int64 and s.lengths.tolist() == [3, 5, 2]
    assert s.rewards.dtype == np.float32 and not s.rewards.flags.writeable
    with pytest.raises(ValueError):
        s.rewards[0] = 3.0
    assert [r.reward for r in g.responses] == [1.0, 0.0, 1.0]  # the records keep theirs
    groups, rewards = groups_and_rewards([s, ScoredGroup(g, [0.0, 0.0, 0.0])])
    assert groups[0] is g and groups[1] is g and rewards[0] is s.rewards
    np.testing.assert_array_equal(rewards[1], np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="3 responses but rewards of shape \\(2,\\)"):
        ScoredGroup(g, [1.0, 0.0])


def test_binary_outcomes_refuse_shaped_and_unscored():
    assert binary_outcomes([True, 0, 1.0]).tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="binary 0/1.*never a shaped reward"):
        binary_outcomes([1.1, 0.0], "p0")
    with pytest.raises(ValueError, match="not scored"):
        binary_outcomes(None, "p0")
    g = make_group([1, 0])
    g.responses[1].outcome = None
    with pytest.raises(ValueError, match="not scored"):
        _ = ScoredGroup(g, [1.0, 0.0]).outcomes


def test_require_scored_names_prompt_sampler_and_worker():
    scored = make_group([1, 0, 1], pid="p1")
    require_scored([scored, ScoredGroup(scored, [1.0, 0.0, 1.0])])
    require_scored([])
    bad = make_group([1, 0, 1], pid="p3")
    bad.sampler, bad.meta["worker"] = "vllm-fp8", "rollout-1"
    bad.responses[1].outcome = None
    with pytest.raises(UnscoredGroupError) as e:
        require_scored([scored, bad])
    assert (e.value.prompt_id, e.value.sampler, e.value.worker) == ("p3", "vllm-fp8", "rollout-1")
    assert str(e.value).startswith("group for prompt 'p3' from sampler 'vllm-fp8' (worker "
                                   "'rollout-1') has 1 unscored responses")
    assert isinstance(e.value, ValueError)
    # A reward of None is unscored too; a ScoredGroup is checked through its group; no worker
    # in meta reads "?".
    other = make_group([1, 1], pid="p4")
    other.responses[0].reward = None
    with pytest.raises(UnscoredGroupError, match=r"'p4' from sampler 'test' \(worker '\?'\)"):
        require_scored([ScoredGroup(other, [1.0, 1.0])])


def test_failed_reward_fraction():
    assert failed_reward_fraction([]) == 0.0
    ok, some = make_group([1, 0, 1, 1]), make_group([0, 0, 1, 0])
    assert failed_reward_fraction([ok, some]) == 0.0
    some.meta["reward_failed"] = [0, 3]  # what the rollout side records for 2 failed calls
    assert failed_reward_fraction([ok, some]) == pytest.approx(2 / 8)
    assert failed_reward_fraction([ScoredGroup(some, [0.0] * 4)]) == pytest.approx(0.5)
