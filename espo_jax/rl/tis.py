"""Truncated importance sampling (TIS): the weight that corrects for the sampler not being pi_old.

The rollout engine samples from pi_sampler, which differs from the learner's pi_old (lower
precision, other kernels, or an older policy in the worker layout); `policy_loss` multiplies
each token's surrogate by
    w_t = min(pi_old / pi_sampler, C)
per token (`tis=token`) or with one ratio per response (`tis=sequence`: the product of its
tokens' ratios), C = `tis_cap`. The weights carry no gradient.
"""

import math

import jax
import jax.numpy as jnp

from espo_jax.rl.token_stats import masked_quantiles, masked_stats

sg = jax.lax.stop_gradient

# The levels `policy_loss` weights at ("off": no weights; their metrics still come when the
# sampler's log-probs are given).
TIS_MODES = ("off", "token", "sequence")

_LOG_WEIGHT_CAP = 80.0  # exp(80) ~ 5.5e34 keeps raw-weight metrics finite in fp32


def tis_weights(old_logp, behaviour_logp, mask, level, cap):
    """Truncated IS weight min(pi_old / pi_sampler, C) per token or per sequence, and metrics."""
    m = mask.astype(old_logp.dtype)
    log_w = jnp.where(m > 0, sg(old_logp) - sg(behaviour_logp), 0.0)
    if level == "sequence":
        log_w = jnp.broadcast_to(log_w.sum(axis=1, keepdims=True), log_w.shape)
    raw = jnp.exp(jnp.minimum(log_w, _LOG_WEIGHT_CAP))
    weights = jnp.exp(jnp.minimum(log_w, math.log(cap)))
    stats = masked_stats(raw, m, "tis/weight_")
    stats.update(masked_quantiles(raw, m, "tis/weight_", (0.99,)))
    stats["tis/truncated_frac"] = ((log_w > math.log(cap)) * m).sum() / jnp.maximum(m.sum(), 1.0)
    return weights, stats
