"""Group advantages, RL-ZVP and the DAPO overlong penalty on hand-built groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.rl import advantages

# Jitted once each: one compile is cheaper than compiling every eager op (eager == jit is
# checked in test_loss_properties).
grpo = jax.jit(advantages.grpo)
rl_zvp = jax.jit(advantages.rl_zvp, static_argnames="base")
overlong_penalty = jax.jit(advantages.overlong_penalty, static_argnames=("max_len", "cache_len"))
adv = advantages


def test_grpo_by_hand():
    # [1, 0, 0, 1]: mean .5, std .5 -> +-0.5 / (0.5 + 1e-6) = +-0.999998.
    # [3, 1]: mean 2, std 1 -> +-1 / (1 + 1e-6). [1, 1, 1, 1]: zero variance -> exactly 0.
    got = grpo(jnp.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    a, b = 0.5 / (0.5 + 1e-6), 1 / (1 + 1e-6)
    np.testing.assert_allclose(got, [[a, -a, -a, a], [b, -b, b, -b], [0, 0, 0, 0]], rtol=1e-6)
    assert np.all(np.asarray(got[2]) == 0.0)


def test_dr_grpo_and_rloo_by_hand():
    r = jnp.array([[1.0, 0.0, 0.0, 0.0]])
    # Dr. GRPO: R - mean = R - 0.25.
    np.testing.assert_allclose(adv.dr_grpo(r), [[0.75, -0.25, -0.25, -0.25]], rtol=1e-6)
    # RLOO: R_i - mean of the others: 1 - 0 = 1; 0 - 1/3 = -1/3.
    np.testing.assert_allclose(adv.rloo(r), [[1.0, -1 / 3, -1 / 3, -1 / 3]], rtol=1e-6)
    with pytest.raises(ValueError, match="G=1"):
        adv.rloo(jnp.ones((3, 1)))
    assert set(adv.ADVANTAGES) == {"grpo", "dr_grpo", "rloo"}


def test_zero_variance_on_numpy_and_jax():
    outcomes = [[1, 1, 1], [0, 0, 0], [1, 0, 1]]
    for xp in (np, jnp):  # the one predicate serves numpy callers (learner, MS-ZVE) and JAX
        got = adv.zero_variance(xp.asarray(outcomes))
        assert isinstance(got, np.ndarray if xp is np else jax.Array)
        np.testing.assert_array_equal(got, [True, True, False])
        np.testing.assert_array_equal(adv.zero_variance(xp.asarray(outcomes) > 0),
                                      [True, True, False])
        np.testing.assert_array_equal(
            adv.zero_variance(xp.asarray([[0.5, 0.5 + 1e-9], [0.2, 0.3]]), atol=1e-6), [1, 0])
    assert adv.zero_variance(np.array([[0.5, 0.5 + 1e-9]])).tolist() == [False]  # atol 0: exact


def test_zvp_signs_by_hand():
    # rows: all right and tied (+1), all wrong and tied (-1), mixed (0), all right but the
    # tie broken by stage 2 (rewards differ: 0), a single right response (+1)
    rewards = [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.2, 1.0]]
    outcomes = [[1, 1], [0, 0], [1, 0], [1, 1]]
    for xp in (np, jnp):
        signs = adv.zvp_signs(xp.asarray(rewards, xp.float32), xp.asarray(outcomes))
        np.testing.assert_array_equal(signs, [1, -1, 0, 0])
        assert signs.dtype == np.int32
        no_wrong = adv.zvp_signs(xp.asarray(rewards, xp.float32), xp.asarray(outcomes),
                                 wrong_groups=False)
        np.testing.assert_array_equal(no_wrong, [1, 0, 0, 0])
    assert adv.zvp_signs(np.array([[0.7]]), np.array([[True]])).tolist() == [1]


def test_rl_zvp_by_hand():
    alpha = 0.1
    # 4 groups of 2 responses, T = 3; response 1 of each group has its last token masked and a
    # large entropy there that must be ignored (also by the max).
    ent = np.array([[0.5, 1.0, 2.0], [0.2, 0.4, 9.0]], np.float32)
    ent = np.broadcast_to(ent, (4, 2, 3))
    mask = np.broadcast_to(np.array([[1, 1, 1], [1, 1, 0]], np.float32), (4, 2, 3))
    outcomes = jnp.array([[1, 1], [0, 0], [1, 0], [1, 1]])
    # Group 3 is all correct but its shaped rewards differ (tie broken by stage 2): GRPO.
    rewards = jnp.array([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.2, 1.0]])
    got = rl_zvp(rewards, outcomes, jnp.asarray(ent), jnp.asarray(mask), alpha)
    # All correct: +alpha H = (0.05, 0.1, 0.2) and (0.02, 0.04, masked 0).
    np.testing.assert_allclose(got[0], [[0.05, 0.1, 0.2], [0.02, 0.04, 0.0]], rtol=1e-6)
    # All wrong: -alpha (max H - H), max over valid tokens: 2.0 and 0.4:
    # -0.1 * (1.5, 1.0, 0.0) and -0.1 * (0.2, 0.0), masked 0.
    np.testing.assert_allclose(got[1], [[-0.15, -0.1, 0.0], [-0.02, 0.0, 0.0]], atol=1e-7)
    # Mixed: GRPO +-0.5 / (0.5 + 1e-6) on valid tokens.
    a = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(got[2], [[a, a, a], [-a, -a, 0.0]], rtol=1e-6)
    # Tie-broken: rewards 1.2, 1.0 -> mean 1.1, std 0.1 -> +-0.1 / (0.1 + 1e-6).
    b = 0.1 / (0.1 + 1e-6)
    np.testing.assert_allclose(got[3], [[b, b, b], [-b, -b, 0.0]], rtol=1e-5)
    # base="rloo" changes only the non-zero-variance groups: mixed [1, 0] -> +-1.
    got_rloo = rl_zvp(rewards, outcomes, jnp.asarray(ent), jnp.asarray(mask), alpha, base="rloo")
    np.testing.assert_allclose(got_rloo[2], [[1, 1, 1], [-1, -1, 0]], rtol=1e-6)
    np.testing.assert_allclose(got_rloo[:2], got[:2])


def test_rl_zvp_rejects_bad_shapes_and_base():
    r = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="entropy and mask"):
        adv.rl_zvp(r, r, jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 5)), 0.1)
    with pytest.raises(ValueError, match="unknown base"):
        adv.rl_zvp(r, r, jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4)), 0.1, base="ppo")


def test_overlong_penalty_by_hand():
    # L_max = 20, L_cache = 4: free up to 16, then (16 - |y|) / 4, then -1 past 20.
    got = overlong_penalty(jnp.array([10, 16, 18, 20, 21]), max_len=20, cache_len=4)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_len"):
        adv.overlong_penalty(jnp.array([1]), max_len=4, cache_len=8)
