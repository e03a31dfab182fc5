"""The MoE router: logits, expert selection (with router replay), and the routing losses.

A router is two steps. `Router` holds the kernel [D, E] and gives fp32 logits
(`router_logits`). A router kind turns the logits into each token's experts and gate weights:
`(logits_NxE, top_k, ..., replay_Nxk) -> (idx_Nxk int32, weights_Nxk)`. Router replay is the
same for every kind (`apply_replay`): recorded expert ids replace the kind's choice, and the
gate weights are the live ones gathered at the used experts, so gradients reach the router
either way. The kinds:
- softmax top-k (Qwen3-MoE, Qwen2-MoE, Mixtral; `select_experts`): the k largest of
  softmax(logits), their probabilities as gates (renormalised with `norm_topk_prob`).

The auxiliary losses (`load_balance_loss` over the softmax probabilities, `z_loss` over the
logits) and `routing_flip_rate` (how often two routings of the same tokens differ) read the
logits and expert ids any kind gives. Token-level arrays are flattened: N = B*T tokens.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from espo_jax.models import quant
from espo_jax.models.config import ModelConfig
from espo_jax.models.layers import weight


# ---- logits --------------------------------------------------------------------------------------
def router_logits(x_NxD: jax.Array, kernel_DxE) -> jax.Array:
    """Router logits in fp32 (the router weight stays high precision)."""
    return jnp.dot(x_NxD.astype(jnp.float32), quant.maybe_dequant(kernel_DxE, jnp.float32))


class Router(nn.Module):
    """Holds the router kernel [D, E]; returns fp32 logits."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        c = self.config
        kernel = weight(self, "kernel", nn.initializers.normal(c.init_std),
                        (x_NxD.shape[-1], c.n_experts), ("embed", None), c.param_dtype)
        return router_logits(x_NxD, kernel)


# ---- router replay (every kind) ------------------------------------------------------------------
def apply_replay(idx_Nxk: jax.Array, replay_Nxk: jax.Array | None, n_experts: int) -> jax.Array:
    """The router's choice `idx_Nxk` with recorded routes replayed: where a token's row of
    `replay_Nxk` holds expert ids (>= 0) they replace the choice; rows containing the sentinel
    -1 (or any id outside [0, E)) keep it."""
    if replay_Nxk is not None:
        replay_Nxk = replay_Nxk.astype(idx_Nxk.dtype)
        in_range = (replay_Nxk >= 0) & (replay_Nxk < n_experts)
        use_replay_N = jnp.all(in_range, axis=-1, keepdims=True)
        idx_Nxk = jnp.where(use_replay_N, replay_Nxk, idx_Nxk)
    return idx_Nxk


# ---- the softmax top-k router --------------------------------------------------------------------
def select_experts(
    logits_NxE: jax.Array,
    top_k: int,
    norm_topk_prob: bool,
    replay_Nxk: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The softmax top-k router: top-k experts of softmax(logits) and their gate weights.

    Router replay (`apply_replay`): the gate weights are the live softmax probabilities
    gathered at the used experts (renormalised when `norm_topk_prob`).
    """
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    _, idx_Nxk = jax.lax.top_k(probs_NxE, top_k)
    idx_Nxk = apply_replay(idx_Nxk, replay_Nxk, logits_NxE.shape[-1])
    weights_Nxk = jnp.take_along_axis(probs_NxE, idx_Nxk, axis=-1)
    if norm_topk_prob:
        weights_Nxk = weights_Nxk / jnp.sum(weights_Nxk, axis=-1, keepdims=True)
    return idx_Nxk.astype(jnp.int32), weights_Nxk


# ---- auxiliary losses ----------------------------------------------------------------------------
def load_balance_loss(
    logits_NxE: jax.Array, idx_Nxk: jax.Array, mask_N: jax.Array | None = None
) -> jax.Array:
    """Switch-style load balancing, as HF `load_balancing_loss_func` (per layer):
    E * sum_e f_e * p_e, f_e = fraction of tokens routed to e (sums to k over e), p_e = mean
    router probability of e. Perfectly uniform routing gives E * E * (k/E) * (1/E) = k."""
    e = logits_NxE.shape[-1]
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    chosen_NxE = jnp.sum(jax.nn.one_hot(idx_Nxk, e, dtype=jnp.float32), axis=1)
    w_N = jnp.ones(probs_NxE.shape[0]) if mask_N is None else mask_N.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(w_N), 1.0)
    f_E = jnp.sum(chosen_NxE * w_N[:, None], axis=0) / denom
    p_E = jnp.sum(probs_NxE * w_N[:, None], axis=0) / denom
    return e * jnp.sum(f_E * p_E)


def z_loss(logits_NxE: jax.Array, mask_N: jax.Array | None = None) -> jax.Array:
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2."""
    z_N = jax.nn.logsumexp(logits_NxE.astype(jnp.float32), axis=-1) ** 2
    w_N = jnp.ones_like(z_N) if mask_N is None else mask_N.astype(jnp.float32)
    return jnp.sum(z_N * w_N) / jnp.maximum(jnp.sum(w_N), 1.0)


# ---- routing measures ----------------------------------------------------------------------------
def routing_flip_rate(
    experts_a: jax.Array, experts_b: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """Fraction of (token, layer) routing decisions whose expert *sets* differ, per MoE layer.

    experts_*: int [..., M, k]; mask: bool [...] (the token axes). Returns float [M]."""
    same = jnp.all(jnp.sort(experts_a, axis=-1) == jnp.sort(experts_b, axis=-1), axis=-1)
    flip = 1.0 - same.astype(jnp.float32)  # [..., M]
    w = jnp.ones(flip.shape[:-1]) if mask is None else mask.astype(jnp.float32)
    axes = tuple(range(flip.ndim - 1))
    return jnp.sum(flip * w[..., None], axis=axes) / jnp.maximum(jnp.sum(w), 1.0)
