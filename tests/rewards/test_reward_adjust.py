"""Tiered reward composition, judge verdicts and advantage inversion on hand-built groups."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.rewards import reward_adjust
from espo_jax.rl import advantages

# Jitted once each (cheaper than compiling every eager op on a busy CPU).
tiered = jax.jit(reward_adjust.tiered_rewards, static_argnames=("tier_gap", "score_scale", "band"))
naive_mix = jax.jit(  # the linear mix that can invert advantages, for comparison
    lambda outcome, score, weight: jnp.asarray(outcome, jnp.float32)
    + weight * jnp.asarray(score, jnp.float32))
inversion_rate = jax.jit(reward_adjust.inversion_rate)
grpo = jax.jit(advantages.grpo)


def test_tiered_rewards_by_hand():
    outcome = jnp.array([[1, 1, 0, 0]])
    score = jnp.array([[0.0, 1.0, -1e6, 1e6]])
    got = tiered(outcome, score)
    # 1 + 0.25 tanh(0) = 1; 1 + 0.25 tanh(1) = 1.190399; 0 - 0.25; 0 + 0.25 (saturated).
    np.testing.assert_allclose(got, [[1.0, 1 + 0.25 * math.tanh(1.0), -0.25, 0.25]], rtol=1e-6)
    # tier_gap 2, score_scale 10: 2 * (1 + 0.25 tanh(0.5)) = 2.231059.
    got = tiered(jnp.array([1]), jnp.array([5.0]), tier_gap=2.0, score_scale=10)
    assert got[0] == pytest.approx(2 * (1 + 0.25 * math.tanh(0.5)), rel=1e-6)
    # Three tiers keep their order whatever the scores: worst of tier k+1 > best of tier k.
    got = tiered(jnp.array([0, 1, 2]), jnp.array([1e9, -1e9, -1e9]))
    np.testing.assert_allclose(got, [0.25, 0.75, 1.75], rtol=1e-6)


def test_tiered_rewards_validation():
    with pytest.raises(ValueError, match="band"):
        reward_adjust.tiered_rewards(jnp.ones(2), jnp.ones(2), band=0.5)
    with pytest.raises(ValueError, match="tier_gap"):
        reward_adjust.tiered_rewards(jnp.ones(2), jnp.ones(2), tier_gap=0.0)


def test_inversion_rate_by_hand():
    # Group: correct (0, 1), wrong (2, 3); naive rewards 1 + .5 * (-2, 1) = (0, 1.5) and
    # 0 + .5 * (3, 0) = (1.5, 0). Pairs (i correct, j wrong) with A_j >= A_i:
    # (0,2): 1.5 >= 0 yes; (0,3): 0 >= 0 yes (a tie counts); (1,2): 1.5 >= 1.5 yes;
    # (1,3): 0 >= 1.5 no -> 3 / 4.
    outcome = jnp.array([[1, 1, 0, 0]])
    score = jnp.array([[-2.0, 1.0, 3.0, 0.0]])
    naive = naive_mix(outcome, score, 0.5)
    np.testing.assert_allclose(naive, [[0.0, 1.5, 1.5, 0.0]])
    a_naive = grpo(naive)
    assert inversion_rate(outcome, a_naive) == pytest.approx(0.75)
    t_rewards = tiered(outcome, score)
    assert inversion_rate(outcome, grpo(t_rewards)) == 0.0
    # A second group with no (correct, wrong) pair adds no pairs: rate stays 3/4.
    outcome2 = jnp.concatenate([outcome, jnp.ones((1, 4), int)])
    a2 = jnp.concatenate([a_naive, jnp.zeros((1, 4))])
    assert inversion_rate(outcome2, a2) == pytest.approx(0.75)
    assert inversion_rate(jnp.ones((2, 3)), jnp.zeros((2, 3))) == 0.0


@pytest.mark.parametrize("base", ["grpo", "dr_grpo", "rloo"])
def test_adversarial_reward_model_inverts_naive_but_never_tiered(base):
    # 64 groups of 8 with mixed outcomes; the reward model prefers wrong answers (+3 for wrong,
    # -3 for correct, plus noise), mixed in with weight 0.5: 1 - 1.5 < 0 + 1.5.
    rng = np.random.default_rng(0)
    outcome = rng.integers(0, 2, (64, 8))
    outcome[:, 0], outcome[:, 1] = 1, 0  # every group mixed
    score = np.where(outcome == 1, -3.0, 3.0) + rng.normal(0, 1, outcome.shape)
    fn = jax.jit(advantages.ADVANTAGES[base])
    naive = fn(naive_mix(outcome, score, 0.5))
    tiered_adv = fn(tiered(outcome, score))
    assert inversion_rate(outcome, naive) > 0.5
    assert inversion_rate(outcome, tiered_adv) == 0.0


def test_judge_to_score():
    verdicts = [["better", "Tie"], [" worse", "tie"]]
    np.testing.assert_array_equal(reward_adjust.judge_to_score(verdicts), [[1, 0], [-1, 0]])
    np.testing.assert_array_equal(reward_adjust.judge_to_score(np.array([1, 0, -1])), [1, 0, -1])
    assert reward_adjust.judge_to_score([]).shape == (0,)
    with pytest.raises(ValueError, match=r"unknown judge verdict\(s\) \['maybe'\]"):
        reward_adjust.judge_to_score(["better", "maybe"])
    with pytest.raises(ValueError, match="code"):
        reward_adjust.judge_to_score([2, 0])
    with pytest.raises(ValueError, match="dtype"):
        reward_adjust.judge_to_score([0.5])
    # Judge scores inside the correct tier: better > tie > worse, all above the wrong answer.
    outcome = jnp.array([[1, 1, 1, 0]])
    score = reward_adjust.judge_to_score([["worse", "tie", "better", "better"]])
    r = tiered(outcome, score)
    t = 0.25 * math.tanh(1.0)
    np.testing.assert_allclose(r, [[1 - t, 1.0, 1 + t, t]], rtol=1e-6)
