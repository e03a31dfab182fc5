"""Shaped rewards on top of the binary outcome: MS-ZVE stage 2, tie-breaking (the reward math;
`espo_jax.zve.tie_break` applies it to each rollout group).

A group whose responses are all right has no reward contrast, so group-relative advantages are
zero. A bounded length term inside the correct tier breaks the tie (shorter right answers rank
higher by default) without ever lifting a wrong answer over a right one: the composition is
`espo_jax.rewards.reward_adjust.tiered_rewards`, whose score band is narrower than the tier gap.

Only correct responses get the length term; wrong ones sit at the bottom of their tier with a
score of 0 (their ranking among themselves would reward "wrong but short", which is not a
behaviour to teach). The outcome itself is untouched: filtering and verification keep using it.

With `wrong_score` (e.g. `arith_step_credit`, the worked solution's steps a response gets right
before its first mistake) wrong responses are ranked by it inside the wrong tier instead: an
all-wrong group whose responses got different numbers of steps right is no longer
zero-variance, and its advantages favour the ones that went further (a process signal where
the outcome gives none). Right still always beats wrong.

The length term cannot break ties between responses of equal length (e.g. a deterministic
worked solution reproduced exactly); those groups stay at zero variance, and the metrics say so.
"""

from __future__ import annotations

import numpy as np

from espo_jax.rewards.reward_adjust import tiered_rewards

PREFER = ("shorter", "longer")


def length_score(length: np.ndarray, max_len: int, prefer: str = "shorter") -> np.ndarray:
    """A score in [-1, 1]: 1 - 2 * length / max_len for "shorter", its negation for "longer"."""
    if prefer not in PREFER:
        raise ValueError(f"length_score: prefer {prefer!r} is not one of {PREFER}")
    if max_len < 1:
        raise ValueError(f"length_score: max_len must be >= 1, got {max_len}")
    length = np.asarray(length, dtype=np.float32)
    if np.any(length < 0) or np.any(length > max_len):
        raise ValueError(f"length_score: lengths must be in [0, max_len={max_len}], got "
                         f"min {length.min()}, max {length.max()}")
    score = 1.0 - 2.0 * length / max_len
    return score if prefer == "shorter" else -score


def tie_break_rewards(outcomes: np.ndarray, lengths: np.ndarray, *, max_len: int,
                      prefer: str = "shorter", tier_gap: float = 1.0, band: float = 0.25,
                      wrong_score: np.ndarray | None = None) -> np.ndarray:
    """Shaped rewards, same shape as `outcomes` (any shape: one group `[G]` or `[N, G]`).

    R = tier_gap * (outcome + band * tanh(score)), score = outcome * length_score(length):
    every right response gets more than tier_gap * (1 - band * tanh(1)) and every wrong one at
    most 0, so right always beats wrong. With `wrong_score` (same shape, in [0, 1]) a wrong
    response's score is it instead of 0: wrong rewards in [0, band * tanh(1) * tier_gap].
    """
    o = np.asarray(outcomes)
    if o.shape != np.shape(lengths):
        raise ValueError(f"tie_break_rewards: outcomes {o.shape} and lengths "
                         f"{np.shape(lengths)} differ in shape")
    if not np.all((o == 0) | (o == 1)):
        raise ValueError("tie_break_rewards: outcomes must be binary 0/1")
    score = o.astype(np.float32) * length_score(lengths, max_len, prefer)
    if wrong_score is not None:
        w = np.asarray(wrong_score, np.float32)
        if w.shape != o.shape or np.any(w < 0) or np.any(w > 1):
            raise ValueError(f"tie_break_rewards: wrong_score must have the outcomes' shape "
                             f"{o.shape} and lie in [0, 1], got shape {w.shape}")
        score = np.where(o == 1, score, w)
    return np.asarray(tiered_rewards(o, score, tier_gap=tier_gap, band=band), dtype=np.float32)
