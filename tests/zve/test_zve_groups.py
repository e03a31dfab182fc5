"""ScoredGroup: a RolloutGroup beside its rewards (read-only), outcomes checked binary."""

import numpy as np
import pytest
from helpers.zve_groups import make_group

from espo_jax.zve.groups import ScoredGroup, binary_outcomes, groups_and_rewards


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
