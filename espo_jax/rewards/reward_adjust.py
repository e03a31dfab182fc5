"""Composing verified outcomes with reward-model scores without advantage inversion.

A scalar reward model can score a wrong answer above a right one. Mixed linearly into the
reward (outcome + weight * score), that flips the order inside a group, and group-relative
advantages then push the policy towards the wrong answer: an *advantage inversion*.
`tiered_rewards` composes in tiers instead: the verified outcome picks the tier and the
score, squashed into a band narrower than the gap between tiers, only orders responses within
a tier. Every group-relative advantage in `espo_jax.rl.advantages.ADVANTAGES` is increasing in
the reward, so a correct response then always gets a strictly higher advantage than a wrong
one in its group (`inversion_rate` = 0).

Three-way judges (better / tie / worse than a reference answer) give scores via
`judge_to_score`; the paper reports they agree with strong judges more than scalar RMs.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

VERDICT_SCORES = {"better": 1.0, "tie": 0.0, "worse": -1.0}


def tiered_rewards(
    outcome_NxG: jax.Array,
    score_NxG: jax.Array,
    *,
    tier_gap: float = 1.0,
    score_scale: float = 1.0,
    band: float = 0.25,
) -> jax.Array:
    """R = tier_gap * outcome + band * tier_gap * tanh(score / score_scale).

    `outcome` is the tier: 0/1 (or bool) for verified wrong/right, or small integers for more
    tiers. The score term lies in the open interval (-band * gap, +band * gap) and `band < 0.5`,
    so the worst response of a tier still beats the best of the tier below by more than
    (1 - 2 band) * tier_gap > 0. `score_scale` sets where tanh saturates (the RM's typical
    spread). Ties in outcome are broken by score, which is MS-ZVE's reward-stage tie-breaking.
    """
    if not 0.0 < band < 0.5:
        raise ValueError(f"band must be in (0, 0.5) so scores cannot cross a tier, got {band}")
    if tier_gap <= 0 or score_scale <= 0:
        raise ValueError(f"tier_gap and score_scale must be > 0, got {tier_gap}, {score_scale}")
    outcome = jnp.asarray(outcome_NxG, jnp.float32)
    score = jnp.asarray(score_NxG, jnp.float32)
    return tier_gap * (outcome + band * jnp.tanh(score / score_scale))


def judge_to_score(verdicts: Sequence | np.ndarray) -> np.ndarray:
    """Three-way judge verdicts against a reference -> scores: better +1, tie 0, worse -1.

    Accepts (nested) sequences or arrays of the strings "better" / "tie" / "worse" (any case)
    or of the integers 1 / 0 / -1, any shape; returns float32 of the same shape. With several
    references per response, average the result over that axis.
    """
    arr = np.asarray(verdicts)
    if arr.dtype.kind in "US":
        lowered = np.char.lower(np.char.strip(arr.astype(str)))
        bad = sorted(set(lowered.ravel().tolist()) - set(VERDICT_SCORES))
        if bad:
            raise ValueError(f"unknown judge verdict(s) {bad}; valid: {sorted(VERDICT_SCORES)}")
        lookup = np.vectorize(VERDICT_SCORES.__getitem__, otypes=[np.float32])
        return lookup(lowered) if lowered.size else lowered.astype(np.float32)
    if arr.dtype.kind in "iub" or (arr.dtype.kind == "f" and np.all(arr == np.round(arr))):
        bad = sorted(set(arr.astype(np.int64).ravel().tolist()) - {-1, 0, 1})
        if bad:
            raise ValueError(f"unknown judge verdict code(s) {bad}; valid: -1, 0, 1")
        return arr.astype(np.float32)
    raise ValueError(f"judge verdicts must be strings or -1/0/1 codes, got dtype {arr.dtype}")


def inversion_rate(outcome_NxG: jax.Array, advantages_NxG: jax.Array) -> jax.Array:
    """Fraction of (correct i, wrong j) pairs in the same group with A_j >= A_i.

    Pairs are counted over all groups together; 0 when no group mixes correct and wrong.
    Log it as `reward/inversion_rate`.
    """
    correct = jnp.asarray(outcome_NxG) > 0
    a = jnp.asarray(advantages_NxG, jnp.float32)
    pairs = correct[:, :, None] & ~correct[:, None, :]  # [N, i, j]: i correct, j wrong
    inverted = pairs & (a[:, None, :] >= a[:, :, None])
    return inverted.sum() / jnp.maximum(pairs.sum(), 1)
