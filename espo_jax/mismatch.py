"""Train-inference mismatch: one computation and one set of metric names.

The learner's old-policy pass (`train.step`), `rollout.mismatch.measure_mismatch` (benchmarks,
notebooks, the GPU check) and every run's metrics call `mismatch_metrics`, so their keys compare:

  mismatch/logp_abs_mean      mean over response tokens of |logp_learner - logp_rollout|
  mismatch/logp_abs_max       its maximum
  mismatch/kl_k3              k3 estimate of KL(rollout || learner) = E_rollout[r - 1 - log r],
                              r = p_learner / p_rollout (the rollout's own samples)
  mismatch/is_weight_max      the largest r, the importance weight's upper tail
  mismatch/tokens             response tokens compared
and, where the rollout recorded the routed experts of an MoE policy:
  moe/routing_flip_rate       share of (token, MoE layer) decisions where the learner's own
                              expert set (`ModelOutput.own_experts`: what its router kind
                              chooses) differs from the recorded one, mean over layers; under
                              replay the experts used are the recorded ones by construction, and
                              the rate says how often replay overrode the learner's choice
  moe/routing_flip_rate/layer_{m}   the same for MoE layer m
  mismatch/logp_abs_mean_at_flips   |dlogp| of tokens predicted at a position where any layer's
  mismatch/logp_abs_mean_elsewhere  routing flipped, and of the rest
  mismatch/tokens_at_flips          how many tokens are at flips

The learner compares its parameters of the moment with the policy that sampled: in the worker
layout a group sampled `async/staleness` updates ago carries those updates' change of the policy
(and of its routing), not only the engine's numerics. There the learner reports the keys above
over the on-policy groups only (staleness 0: the figures compare with the single process's) and
the same keys as `mismatch_stale/...` and `moe_stale/...` over the stale ones
(`train.step.old_policy_metrics`). The DeepSeek-V3 small variant in the worker layout (AMD
EPYC, 2026-12-06): 0.0027 at staleness 0, 0.040 at staleness 1 (routing flip rate 0.02 and
0.38).

Positions are aligned as the learner's rows are: `logp[b, t]` is the log-prob of the token that
position t predicts, and the routing at [b, t] is the one computed at position t.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from espo_jax import models


def _mean(x, w):
    return jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)


def logp_metrics(learner_logp_BxT: jax.Array, rollout_logp_BxT: jax.Array, mask_BxT: jax.Array,
                 flipped_BxT: jax.Array | None = None) -> dict[str, jax.Array]:
    """The log-prob keys of the module docstring over the tokens where `mask` > 0; with
    `flipped` (1 where the position's routing flipped in any layer, `routing_metrics`), the
    split at flips and elsewhere too."""
    mask = (mask_BxT > 0).astype(jnp.float32)
    d = (learner_logp_BxT - rollout_logp_BxT) * mask  # log r
    abs_d = jnp.abs(d)
    out = {
        "mismatch/logp_abs_mean": _mean(abs_d, mask),
        "mismatch/logp_abs_max": jnp.max(abs_d),
        "mismatch/kl_k3": _mean(jnp.expm1(d) - d, mask),
        "mismatch/is_weight_max": jnp.max(jnp.where(mask > 0, jnp.exp(d), 0.0)),
        "mismatch/tokens": jnp.sum(mask),
    }
    if flipped_BxT is not None:
        at_flips = mask * (flipped_BxT > 0)
        out["mismatch/logp_abs_mean_at_flips"] = _mean(abs_d, at_flips)
        out["mismatch/logp_abs_mean_elsewhere"] = _mean(abs_d, mask - at_flips)
        out["mismatch/tokens_at_flips"] = jnp.sum(at_flips)
    return out


def routing_metrics(own_BxTxMxk: jax.Array, recorded_BxTxMxk: jax.Array,
                    position_weights_BxT: jax.Array | None = None):
    """(the flip-rate keys of the module docstring, flipped_BxT): `flipped` is 1 at recorded
    positions where any layer's own choice differs from the recorded one. `recorded` holds -1
    at positions without a recording; `position_weights`: how often each position counts (a
    shared prompt's position once per response), 1 where None."""
    recorded = jnp.all(recorded_BxTxMxk >= 0, axis=(-2, -1)).astype(jnp.float32)  # [B, T]
    if position_weights_BxT is not None:
        recorded = recorded * position_weights_BxT
    per_layer = models.routing_flip_rate(own_BxTxMxk, recorded_BxTxMxk, recorded)
    out = {"moe/routing_flip_rate": jnp.mean(per_layer)}
    for m in range(per_layer.shape[0]):
        out[f"moe/routing_flip_rate/layer_{m}"] = per_layer[m]
    same = jnp.all(jnp.sort(own_BxTxMxk, -1) == jnp.sort(recorded_BxTxMxk, -1), axis=-1)
    flipped = (jnp.any(~same, axis=-1) & (recorded > 0)).astype(jnp.float32)
    return out, flipped


def mismatch_metrics(
    learner_logp_BxT: jax.Array,
    rollout_logp_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    own_BxTxMxk: jax.Array | None = None,
    recorded_BxTxMxk: jax.Array | None = None,
    position_weights_BxT: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Every key of the module docstring, where log-probs and routing share rows and
    positions (`logp_metrics` and `routing_metrics` for rows that differ, e.g. packed ones).

    `own` / `recorded`: the learner's own routing and the rollout's recorded one; both or
    neither."""
    if (own_BxTxMxk is None) != (recorded_BxTxMxk is None):
        raise ValueError("mismatch_metrics: give both own and recorded routing, or neither")
    if own_BxTxMxk is None:
        return logp_metrics(learner_logp_BxT, rollout_logp_BxT, mask_BxT)
    routing, flipped = routing_metrics(own_BxTxMxk, recorded_BxTxMxk, position_weights_BxT)
    return {**logp_metrics(learner_logp_BxT, rollout_logp_BxT, mask_BxT, flipped), **routing}
