"""The mixture-of-experts layer: `MoeBlock` wires the router, the dispatch to the experts and
the auxiliary losses, each a separate function of its own module.

Per token: `router.Router` gives fp32 logits, `router.route` the experts and their gate
weights by the router kind `ModelConfig.router` names (recorded routes replayed where given), a
`moe_dispatch` implementation (`ModelConfig.dispatch`) runs each token through its experts'
SwiGLU and sums the outputs weighted by the gates (traced on a mesh whose `expert` axis is > 1,
expert parallel: `moe_ep`); an optional Qwen2-MoE shared expert adds a
sigmoid-gated dense MLP, and DeepSeek / GLM shared experts (`n_shared_experts`) an ungated one
of width n_shared_experts * d_expert that every token passes through.
The layer returns the per-layer `router.load_balance_loss`, `router.z_loss` and the dropped
fraction (capacity dispatch) for the model's aux loss and metrics.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from espo_jax.models import moe_ep, quant
from espo_jax.models.config import ModelConfig
from espo_jax.models.layers import Mlp, dense, weight
from espo_jax.models.moe_dispatch import (
    capacity_dispatch,
    dense_dispatch,
    dropless_dispatch,
    ragged_dispatch,
)
from espo_jax.models.router import Router, load_balance_loss, route, z_loss


class MoeBlock(nn.Module):
    """Router + experts (+ optional Qwen2-MoE shared expert with a sigmoid gate, + optional
    always-on shared experts). Returns (y, router logits, experts used, the router's own
    choice, per-layer stats)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, replay_BxTxk: jax.Array | None,
                 mask_BxT: jax.Array | None):
        c = self.config
        b, t, d = x_BxTxD.shape
        e, f = c.n_experts, c.d_expert
        x_NxD = x_BxTxD.reshape(b * t, d)
        mask_N = None if mask_BxT is None else mask_BxT.reshape(b * t)
        logits_NxE, bias_E = Router(c, name="router")(x_NxD)
        replay_Nxk = None if replay_BxTxk is None else replay_BxTxk.reshape(b * t, c.top_k)
        mesh = moe_ep.active_mesh(e)
        if mesh is None:
            idx_Nxk, weights_Nxk, own_Nxk = route(c, logits_NxE, bias_E, replay_Nxk)
        else:
            idx_Nxk, weights_Nxk, own_Nxk = moe_ep.ep_route(
                functools.partial(route, c), logits_NxE, bias_E, replay_Nxk, mesh=mesh)

        init = nn.initializers.normal(c.init_std)
        wg = weight(self, "wi_gate", init, (e, d, f), ("exp", "embed", "mlp"), c.param_dtype)
        wu = weight(self, "wi_up", init, (e, d, f), ("exp", "embed", "mlp"), c.param_dtype)
        wo = weight(self, "wo", init, (e, f, d), ("exp", "mlp", "embed"), c.param_dtype)
        wg, wu, wo = (quant.maybe_dequant(w, c.dtype) for w in (wg, wu, wo))
        xc = x_NxD.astype(c.dtype)
        dropped = jnp.zeros((), jnp.float32)
        if mesh is not None:  # traced on a mesh with expert > 1
            y_NxD, dropped = moe_ep.ep_dispatch(
                xc, idx_Nxk, weights_Nxk, wg, wu, wo, mesh=mesh, local=c.dispatch,
                capacity_factor=c.capacity_factor if c.dispatch == "capacity" else None,
                chunk=c.ep_chunk)
        elif c.dispatch in ("dropless", "dropless_loop"):
            y_NxD = dropless_dispatch(xc, idx_Nxk, weights_Nxk, wg, wu, wo,
                                      loop=c.dispatch == "dropless_loop")
        elif c.dispatch == "capacity":
            y_NxD, dropped = capacity_dispatch(xc, idx_Nxk, weights_Nxk, wg, wu, wo,
                                               c.capacity_factor, mask_N)
        elif c.dispatch == "ragged":
            y_NxD = ragged_dispatch(xc, idx_Nxk, weights_Nxk, wg, wu, wo)
        else:
            y_NxD = dense_dispatch(xc, idx_Nxk, weights_Nxk, wg, wu, wo)

        if c.shared_expert_d_ff:
            shared = Mlp(c, c.shared_expert_d_ff, name="shared_expert")(xc)
            gate = dense(c, 1, ("embed", None), "shared_expert_gate")(xc)
            y_NxD = y_NxD + nn.sigmoid(gate.astype(jnp.float32)).astype(c.dtype) * shared
        if c.n_shared_experts:
            y_NxD = y_NxD + Mlp(c, c.n_shared_experts * f, name="shared_experts")(xc)

        aux_N = mask_N  # the aux losses' token weights
        if c.aux_loss_tokens == "all" and mask_N is not None:  # padding positions count once
            aux_N = jnp.where(mask_N > 0, mask_N, 1).astype(jnp.float32)
        scoring = "sigmoid" if c.router == "sigmoid_group" else "softmax"
        stats = {"load_balance_loss": load_balance_loss(logits_NxE, idx_Nxk, aux_N, scoring),
                 "z_loss": z_loss(logits_NxE, aux_N), "dropped_frac": dropped}
        return (y_NxD.reshape(b, t, d), logits_NxE.reshape(b, t, e),
                idx_Nxk.reshape(b, t, c.top_k), own_Nxk.reshape(b, t, c.top_k), stats)
