"""The MoE router: logits, expert selection (with router replay), and the routing losses.

A router is two steps. `Router` holds the kernel [D, E] and gives fp32 logits
(`router_logits`). A router kind turns the logits into each token's experts and gate weights:
`(logits_NxE, top_k, ..., replay_Nxk) -> (idx_Nxk int32, weights_Nxk)`. Router replay is the
same for every kind (`apply_replay`): recorded expert ids replace the kind's choice, and the
gate weights are the live ones gathered at the used experts, so gradients reach the router
either way. The kinds:
- softmax top-k (Qwen3-MoE, Qwen2-MoE, Mixtral; `select_experts`): the k largest of
  softmax(logits), their probabilities as gates (renormalised with `norm_topk_prob`).
- sigmoid group-limited (DeepSeek-V3, GLM-4.5; `select_sigmoid_group`): scores sigmoid(logits);
  the choice reads scores + a per-expert correction bias (the gates never do), searched only
  in the `topk_group` best of `n_group` groups; gates are the chosen unbiased scores
  (renormalised with `norm_topk_prob`) times `routed_scaling_factor`. The bias is a parameter
  no gradient reaches; DeepSeek's auxiliary-loss-free balancing moves it by expert load
  (`update_correction_bias`).
`route` picks the kind `ModelConfig.router` names and also returns the kind's own choice
before replay (the learner's live routing for the mismatch metrics).

The auxiliary losses (`load_balance_loss` over the softmax probabilities, `z_loss` over the
logits) and `routing_flip_rate` (how often two routings of the same tokens differ) read the
logits and expert ids any kind gives. Token-level arrays are flattened: N = B*T tokens.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from espo_jax.models import quant, scan
from espo_jax.models.config import ModelConfig
from espo_jax.models.layers import weight


# ---- logits --------------------------------------------------------------------------------------
def router_logits(x_NxD: jax.Array, kernel_DxE) -> jax.Array:
    """Router logits in fp32 (the router weight stays high precision)."""
    return jnp.dot(x_NxD.astype(jnp.float32), quant.maybe_dequant(kernel_DxE, jnp.float32))


class Router(nn.Module):
    """Holds the router kernel [D, E] (and, for the sigmoid kind, the correction bias [E],
    kept fp32); returns fp32 logits and the bias (None for the softmax kind)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_NxD: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        c = self.config
        kernel = weight(self, "kernel", nn.initializers.normal(c.init_std),
                        (x_NxD.shape[-1], c.n_experts), ("embed", None), c.param_dtype)
        bias_E = None
        if c.router == "sigmoid_group":
            bias_E = weight(self, "e_score_correction_bias", nn.initializers.zeros,
                            (c.n_experts,), (None,), jnp.float32)
        return router_logits(x_NxD, kernel), bias_E


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


# ---- the sigmoid group-limited router ----------------------------------------------------------
def select_sigmoid_group(
    logits_NxE: jax.Array,
    bias_E: jax.Array,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    replay_Nxk: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sigmoid group-limited router (DeepSeek-V3 `noaux_tc`, GLM-4.5). Returns (experts used
    [N, k], their gates [N, k], the router's own choice [N, k] before replay).

    choice_e = sigmoid(logit_e) + bias_e; each of the `n_group` groups of E / n_group experts
    scores the sum of its two largest choice values, and the k experts are the largest choice
    values within the `topk_group` best groups. Gates: sigmoid(logit) at the experts used (the
    recorded ones under replay), over their sum (+1e-20, as transformers) when
    `norm_topk_prob`, times `scaling`. The bias only orders the experts: no gradient reaches it.
    """
    n, e = logits_NxE.shape
    scores_NxE = jax.nn.sigmoid(logits_NxE.astype(jnp.float32))
    choice_NxE = jax.lax.stop_gradient(scores_NxE + bias_E)  # orders experts only
    if n_group > 1:
        grouped_NxGxS = choice_NxE.reshape(n, n_group, e // n_group)
        group_scores_NxG = jnp.sum(jax.lax.top_k(grouped_NxGxS, 2)[0], axis=-1)
        _, groups_Nxg = jax.lax.top_k(group_scores_NxG, topk_group)
        keep_NxG = jnp.any(groups_Nxg[:, :, None] == jnp.arange(n_group), axis=1)
        keep_NxE = jnp.repeat(keep_NxG, e // n_group, axis=1)
        choice_NxE = jnp.where(keep_NxE, choice_NxE, -jnp.inf)
    _, own_Nxk = jax.lax.top_k(choice_NxE, top_k)
    idx_Nxk = apply_replay(own_Nxk, replay_Nxk, e)
    weights_Nxk = jnp.take_along_axis(scores_NxE, idx_Nxk, axis=-1)
    if norm_topk_prob:
        weights_Nxk = weights_Nxk / (jnp.sum(weights_Nxk, axis=-1, keepdims=True) + 1e-20)
    return idx_Nxk.astype(jnp.int32), weights_Nxk * scaling, own_Nxk.astype(jnp.int32)


def update_correction_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, sec. 2.1.2): after a
    step, each expert's bias moves by `rate` towards balance: down when its load (tokens routed
    to it) is above the mean load over experts, up when below, unchanged at the mean."""
    load_E = load_E.astype(jnp.float32)
    return bias_E + rate * jnp.sign(jnp.mean(load_E) - load_E)


def expert_load(routed_experts_NxMxk: jax.Array, n_experts: int,
                mask_N: jax.Array | None = None) -> jax.Array:
    """Tokens routed to each expert per MoE layer, [M, E] (padding excluded through `mask_N`)."""
    w_N = (jnp.ones(routed_experts_NxMxk.shape[0]) if mask_N is None
           else mask_N.astype(jnp.float32))
    onehot_NxMxkxE = jax.nn.one_hot(routed_experts_NxMxk, n_experts, dtype=jnp.float32)
    return jnp.einsum("nmke,n->me", onehot_NxMxkxE, w_N)


def update_router_biases(config: ModelConfig, params: dict, routed_experts_BxTxMxk: jax.Array,
                         weights_BxT: jax.Array | None = None) -> dict:
    """`params` with every MoE layer's correction bias moved by `update_correction_bias` at
    rate `config.router_bias_update_rate`, from the expert loads of a batch's routing
    (`ModelOutput.routed_experts`, or a rollout's recording; `weights_BxT` 0 on padding).
    Unchanged (the same object) when the rate is 0, the default: the bias is frozen."""
    c = config
    if c.router != "sigmoid_group" or not c.router_bias_update_rate or not c.n_moe_layers:
        return params
    b, t, m, k = routed_experts_BxTxMxk.shape
    mask_N = None if weights_BxT is None else weights_BxT.reshape(b * t)
    load_MxE = expert_load(routed_experts_BxTxMxk.reshape(b * t, m, k), c.n_experts, mask_N)
    params = dict(params)
    for j, i in enumerate(c.moe_layers):
        (key, *block), rep = scan.locate(c, i)  # a scanned run: its q-th block, repeat `rep`
        run = params[key]
        layer = run[block[0]] if block else run
        moe = layer["moe"]
        bias = moe["router"]["e_score_correction_bias"]
        new = update_correction_bias(bias if rep is None else bias[rep], load_MxE[j],
                                     c.router_bias_update_rate)
        layer = {**layer, "moe": {**moe, "router": {
            **moe["router"], "e_score_correction_bias": new if rep is None
            else bias.at[rep].set(new)}}}
        params[key] = {**run, block[0]: layer} if block else layer
    return params


# ---- the kinds by name ---------------------------------------------------------------------------
def route(config: ModelConfig, logits_NxE: jax.Array, bias_E: jax.Array | None,
          replay_Nxk: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`config.router`'s kind: (experts used, gates, the kind's own choice before replay)."""
    c = config
    if c.router == "sigmoid_group":
        return select_sigmoid_group(logits_NxE, bias_E, c.top_k, c.n_group, c.topk_group,
                                    c.norm_topk_prob, c.routed_scaling_factor, replay_Nxk)
    idx_Nxk, weights_Nxk = select_experts(logits_NxE, c.top_k, c.norm_topk_prob, replay_Nxk)
    own_Nxk = jax.lax.top_k(jax.lax.stop_gradient(logits_NxE), c.top_k)[1].astype(jnp.int32)
    return idx_Nxk, weights_Nxk, own_Nxk


# ---- auxiliary losses ----------------------------------------------------------------------------
def load_balance_loss(
    logits_NxE: jax.Array, idx_Nxk: jax.Array, mask_N: jax.Array | None = None,
    scoring: str = "softmax",
) -> jax.Array:
    """Switch-style load balancing, as HF `load_balancing_loss_func` (per layer):
    E * sum_e f_e * p_e, f_e = fraction of tokens routed to e (sums to k over e), p_e = mean
    router probability of e. Perfectly uniform routing gives E * E * (k/E) * (1/E) = k.
    `scoring` "sigmoid": p are the sigmoid scores normalised over experts (DeepSeek-V3's
    balance loss)."""
    e = logits_NxE.shape[-1]
    if scoring == "sigmoid":
        scores_NxE = jax.nn.sigmoid(logits_NxE.astype(jnp.float32))
        probs_NxE = scores_NxE / jnp.sum(scores_NxE, axis=-1, keepdims=True)
    else:
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
