"""MS-ZVE stage 3 and the one zero-variance predicate: the learner's RL-ZVP signs, `rl_zvp`,
the online filter's keep mask and the metrics' zero-variance count agree on scripted groups."""

import numpy as np
from helpers.zve_groups import make_group

from espo_jax.train.advantages import group_advantages
from espo_jax.zve import zvp
from espo_jax.zve.config import default_zve_config
from espo_jax.zve.groups import ScoredGroup
from espo_jax.zve.metrics import step_metrics
from espo_jax.zve.online_filter import filter_groups

# Four groups of G = 3 (rl_zvp needs equal sizes), outcomes and MS-ZVE rewards:
#   A [1, 0, 1] rewards [1, 0, 1]          mixed: outcomes differ -> not zero-variance, sign 0
#   B [1, 1, 1] rewards [1, 1, 1]          all right, rewards equal -> zero-variance, sign +1
#   C [0, 0, 0] rewards [0, 0, 0]          all wrong, rewards equal -> zero-variance, sign -1
#   D [1, 1, 1] rewards [1.1, 1.0, 1.05]   all right but stage 2 broke the tie: rewards differ
#                                          -> not zero-variance, sign 0
# Filter (outcomes only): keeps A (min 0 != max 1); drops B, C and D (all-equal outcomes).
# Metrics: zero-variance by outcome B, C, D = 3 of 4; by reward B, C = 2 of 4.
OUTCOMES = [[1, 0, 1], [1, 1, 1], [0, 0, 0], [1, 1, 1]]
REWARDS = [[1, 0, 1], [1, 1, 1], [0, 0, 0], [1.1, 1.0, 1.05]]
SIGNS = [0, 1, -1, 0]


def test_learner_rl_zvp_filter_and_metrics_agree():
    groups = [make_group(o, pid=f"g{i}") for i, o in enumerate(OUTCOMES)]
    rewards = [np.asarray(r, np.float32) for r in REWARDS]
    _, learner_signs = group_advantages(groups, rewards, "grpo", use_zvp=True)
    np.testing.assert_array_equal(learner_signs, np.repeat(SIGNS, 3))
    np.testing.assert_array_equal(zvp.zvp_signs(np.stack(rewards), np.array(OUTCOMES)), SIGNS)
    # rl_zvp: positive where +1 (alpha * H > 0), negative (or 0 at the max-entropy token)
    # where -1, the GRPO advantage where 0
    entropy = np.broadcast_to(np.array([1.0, 2.0]), (4, 3, 2)).astype(np.float32)
    mask = np.ones((4, 3, 2), np.float32)
    adv = np.asarray(zvp.rl_zvp(np.stack(rewards), np.array(OUTCOMES, np.float32), entropy,
                                mask, 0.1))
    np.testing.assert_allclose(adv[1], 0.1 * entropy[1], rtol=1e-6)  # +alpha * H
    np.testing.assert_allclose(adv[2], -0.1 * (2.0 - entropy[2]), rtol=1e-6)
    grpo = np.asarray(zvp.rl_zvp(np.stack(rewards), np.array(OUTCOMES, np.float32), entropy,
                                 mask, 0.0))
    np.testing.assert_array_equal(adv[[0, 3]], grpo[[0, 3]])
    keep = filter_groups(OUTCOMES)
    assert keep.tolist() == [True, False, False, False]
    scored = [ScoredGroup(g, r) for g, r in zip(groups, rewards, strict=True)]
    m = step_metrics(scored, [scored[0]])
    assert m["zve/zero_variance_frac_before"] == 3 / 4
    assert m["zve/zero_variance_frac_after_tiebreak"] == 2 / 4
    # one predicate: the filter drops exactly the outcome-zero-variance groups, and the groups
    # with a sign are exactly the reward-and-outcome zero-variance ones
    zv_outcome = zvp.zero_variance(np.array(OUTCOMES))
    zv_both = zv_outcome & zvp.zero_variance(np.stack(rewards))
    assert (~keep).tolist() == zv_outcome.tolist()
    assert (np.array(SIGNS) != 0).tolist() == zv_both.tolist()


def test_wrong_groups_switch():
    # zve.zvp.wrong_groups=False: the all-wrong group C keeps a zero sign, everywhere
    groups = [make_group(o) for o in OUTCOMES]
    rewards = [np.asarray(r, np.float32) for r in REWARDS]
    _, signs = group_advantages(groups, rewards, "grpo", use_zvp=True, zvp_wrong=False)
    np.testing.assert_array_equal(signs, np.repeat([0, 1, 0, 0], 3))
    np.testing.assert_array_equal(
        zvp.zvp_signs(np.stack(rewards), np.array(OUTCOMES), wrong_groups=False), [0, 1, 0, 0])


def test_stage3_switch_reaches_rl_zvp():
    """The learner applies stage 3; its config alpha turns a tied group into signal."""
    cfg = default_zve_config()
    cfg.zvp.enabled = True
    outcomes = np.array([[1.0, 1.0], [1.0, 0.0]])
    entropy = np.array([[[0.5, 1.0], [2.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
    mask = np.array([[[1, 1], [1, 0]], [[1, 1], [1, 1]]])
    adv = np.asarray(zvp.rl_zvp(outcomes, outcomes, entropy, mask, cfg.zvp.alpha))
    # all-right group 0: A_t = alpha * H_t = 0.1 * [.5, 1], 0.1 * [2, (masked) 0]
    np.testing.assert_allclose(adv[0], [[0.05, 0.1], [0.2, 0.0]], rtol=1e-6)
    # mixed group 1: GRPO (1 - .5) / std(.5) = +1 and -1 on every token
    np.testing.assert_allclose(adv[1], [[1.0, 1.0], [-1.0, -1.0]], rtol=1e-4)
