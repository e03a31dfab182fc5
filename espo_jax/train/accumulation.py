"""Gradient accumulation: one update's loss, gradients and metrics from pieces of its batch.

The learner splits an update's rows twice: into parts, one per host thread
(`step.rl_part_gradients`), and each part into equal micro-batches run by `lax.scan`
(`accumulate_gradients`), so no forward holds a whole update's activations at once. Both
join their pieces by the same rule: piece b enters with weight w_b / sum w, w_b the piece's
denominator of the loss's mean (tokens or rows), so the result is the whole batch's mean
whatever padding leaves in each piece; metrics join alike (`weighted_metrics`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from espo_jax.models import precision


def _split_micro(tree, n_micro: int):
    def split(x):
        if x is None:
            return None
        if x.shape[0] % n_micro:
            raise ValueError(f"batch of {x.shape[0]} rows not divisible by {n_micro} micro-batches")
        return x.reshape(n_micro, x.shape[0] // n_micro, *x.shape[1:])

    return jax.tree.map(split, tree)


def accumulate_gradients(loss_fn, params, batch, n_micro: int, weight_fn=None,
                         model_config=None):
    """Loss, gradients and metrics of `batch` over `n_micro` equal micro-batches (lax.scan).

    `weight_fn(micro_batch)` is the denominator of the loss's mean (tokens or rows, see
    `losses.aggregation_weight`): micro-batch b enters with weight w_b / sum w, so the result
    equals the full batch's mean even when padding rows leave micro-batches unequal. Without it
    every micro-batch weighs the same. The sums are float32 whatever the parameters' dtype.
    With `model_config`, the parameters the model reads in its compute dtype are cast to it
    once and differentiated there (`precision.compute_params`): the same forward and products,
    one float32 accumulator and no float32 gradient per micro-batch (with one micro-batch the
    gradients come back in the parameters' dtype, a conversion XLA fuses into the update)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    compute = params if model_config is None else precision.compute_params(model_config, params)
    if n_micro == 1:
        (loss, metrics), grads = grad_fn(compute, batch)
        return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), metrics
    micro = _split_micro(batch, n_micro)

    def body(carry, mb):
        (loss, metrics), grads = grad_fn(compute, mb)
        w = jnp.ones(()) if weight_fn is None else weight_fn(mb).astype(jnp.float32)
        acc_loss, acc_grads, acc_w = carry
        acc_grads = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), acc_grads, grads)
        return (acc_loss + w * loss.astype(jnp.float32), acc_grads, acc_w + w), (metrics, w)

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    init = (jnp.zeros((), jnp.float32), zeros, jnp.zeros((), jnp.float32))
    (loss, grads, total_w), (metrics, w_b) = jax.lax.scan(body, init, micro)
    scale = 1.0 / jnp.maximum(total_w, 1e-12)
    grads = jax.tree.map(lambda g: g * scale, grads)
    return loss * scale, grads, weighted_metrics(metrics, w_b * scale)


def weighted_metrics(metrics_P: dict, share_P: jax.Array) -> dict:
    """Metrics of P parts of a batch (each stacked on a leading axis) as the whole batch's:
    means weighted by each part's share of the loss's weight, extremes (`*max`, `/max_*`,
    `*min`) as extremes, counts (`/num_*`, `mismatch/tokens*`) summed."""
    def reduce(key, m):
        if "/num_" in key or key.startswith("mismatch/tokens"):
            return jnp.sum(m, axis=0)
        if key.endswith("max") or "/max_" in key:
            return jnp.max(m, axis=0)
        if key.endswith("min"):
            return jnp.min(m, axis=0)
        return jnp.tensordot(share_P, m.astype(jnp.float32), axes=1)

    return {key: reduce(key, m) for key, m in metrics_P.items()}


def join_parts(parts):
    """Loss, gradients and metrics of a batch from its parts' `step.rl_part_gradients` (or
    `step.sft_part_gradients`): each a (loss, grads, metrics, weight); part p enters with weight
    w_p / sum w, so the policy loss, its gradients and the metrics are the whole batch's
    (`accumulate_gradients`' rule; the MoE aux loss, as there, is the same mean of each part's
    own)."""
    w_P = jnp.stack([p[3] for p in parts])
    share_P = w_P / jnp.maximum(jnp.sum(w_P), 1e-12)
    loss = jnp.dot(share_P, jnp.stack([p[0] for p in parts]))
    grads = jax.tree.map(lambda *g: sum(s * x for s, x in zip(share_P, g, strict=True)),
                         *(p[1] for p in parts))
    metrics = weighted_metrics(jax.tree.map(lambda *m: jnp.stack(m), *(p[2] for p in parts)),
                               share_P)
    return loss, grads, metrics
