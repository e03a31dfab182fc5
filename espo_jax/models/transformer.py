"""The decoder: blocks, the pure `forward`, `init_params`, and the KV cache.

`forward(config, params, tokens_BxT, ...)` is a pure function of a plain parameter pytree (the
Linen module is applied inside), so the learner can `jax.grad` it and the engine can `jax.jit`
it with static shapes. The parameter tree is described in the package docstring
(espo_jax/models/__init__.py); the cache layout in `init_cache`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from espo_jax.models import gated_deltanet, gqa, mla, quant, scan
from espo_jax.models.config import ModelConfig
from espo_jax.models.layers import Dense, Mlp, rms_norm, weight
from espo_jax.models.mla import LatentAttention, latent_cache_shapes
from espo_jax.models.moe import MoeBlock

ATTENTION_MODULES = {"gqa": gqa.Attention, "mla": LatentAttention}


@flax.struct.dataclass
class ModelOutput:
    """What `forward` returns. `logits` is None when `return_logits=False`; `hidden` (the
    final-normed hidden state) is None unless `return_hidden=True`; `cache` is None unless a
    cache was passed in."""

    logits: jax.Array | None  # [B, T, V] float32
    hidden: jax.Array | None  # [B, T, D]
    router_logits: tuple[jax.Array, ...]  # M arrays [B, T, E] float32
    routed_experts: jax.Array  # int32 [B, T, M, k], the experts actually used
    # int32 [B, T, M, k]: the experts the router kind itself chooses from these inputs (equal
    # to routed_experts without replay; under replay the learner's own live choice)
    own_experts: jax.Array
    aux_loss: jax.Array  # aux_loss_coef * load balance + z_loss_coef * z-loss (layer means)
    metrics: dict[str, jax.Array]
    cache: dict | None = None


class Block(nn.Module):
    """Pre-norm attention, then pre-norm MoE (or dense SwiGLU) MLP, each with a residual."""

    config: ModelConfig
    moe: bool
    linear: bool = False  # a Gated DeltaNet token mixer ("linear_attention") instead

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, segments_BxT, replay_BxTxk, cache,
                 cache_mask_BxS, weights_BxT=None):
        c = self.config
        mixer = (gated_deltanet.GatedDeltaNet(c, name="linear_attn") if self.linear
                 else ATTENTION_MODULES[c.attention](c, name="attn"))
        h, new_cache = mixer(
            rms_norm(c, "attn_norm")(x_BxTxD), positions_BxT, segments_BxT, cache, cache_mask_BxS
        )
        x_BxTxD = x_BxTxD + h
        y = rms_norm(c, "mlp_norm")(x_BxTxD)
        if self.moe:
            weights = segments_BxT > 0 if weights_BxT is None else weights_BxT
            y, logits, experts, own, stats = MoeBlock(c, name="moe")(y, replay_BxTxk, weights)
            routing = (logits, experts, stats, own)
        else:
            y, routing = Mlp(c, c.d_ff, name="mlp")(y), None
        return x_BxTxD + y, new_cache, routing


class Embed(nn.Module):
    """Token embedding [V, D]; `attend` gives logits against it (tied LM head)."""

    config: ModelConfig

    def setup(self):
        c = self.config
        self.embedding = weight(self, "embedding", nn.initializers.normal(c.init_std),
                                (c.vocab_size, c.d_model), ("vocab", "embed"), c.param_dtype)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        if quant.is_quantized(self.embedding):
            return jnp.take(quant.maybe_dequant(self.embedding, self.config.dtype), tokens_BxT,
                            axis=0)
        # The rows, then their dtype: converting the table first converts all V rows (per
        # call, hoisted out of a decode loop), and XLA:CPU gathers bf16 as fp32.
        return jnp.take(self.embedding, tokens_BxT, axis=0).astype(self.config.dtype)

    def attend(self, x_BxTxD: jax.Array) -> jax.Array:
        c = self.config
        # fp32 logits straight from the product (`layers.matmul`: the fast bf16 path on CPU)
        return jnp.dot(x_BxTxD.astype(c.dtype), quant.maybe_dequant(self.embedding, c.dtype).T,
                       preferred_element_type=jnp.float32)


def _constrain(x_BxTxD: jax.Array) -> jax.Array:
    """Residual-stream sharding by logical names; a no-op outside
    `espo_jax.sharding.activation_sharding` (no rules set)."""
    return nn.with_logical_constraint(x_BxTxD, ("batch", "length", "embed"))


class Cycle(nn.Module):
    """One repeat of a scanned run (`espo_jax.models.scan`): its blocks in order. Carry: the
    residual stream; per repeat: the replayed experts of its MoE blocks [B, T, Q, k]."""

    config: ModelConfig
    kinds: tuple[tuple[bool, str], ...]  # (moe, layer type) of each block

    @nn.compact
    def __call__(self, x_BxTxD, replay_BxTxQxk, positions_BxT, segments_BxT, weights_BxT):
        c, routings, m = self.config, [], 0
        block = nn.remat(Block) if c.remat else Block
        for q, (moe, layer_type) in enumerate(self.kinds):
            replay = None
            if moe and replay_BxTxQxk is not None:
                replay, m = replay_BxTxQxk[:, :, m], m + 1
            x_BxTxD, _, routing = block(c, moe, layer_type == "linear_attention",
                                        name=f"layer_{q}")(
                x_BxTxD, positions_BxT, segments_BxT, replay, None, None, weights_BxT)
            x_BxTxD = _constrain(x_BxTxD)
            if routing is not None:
                routings.append(routing)
        return x_BxTxD, tuple(routings)


def _scanned_run(c: ModelConfig, run: scan.Run, x, replay_BxTxMxk, positions_BxT, segments_BxT,
                 weights_BxT) -> tuple[jax.Array, list]:
    """A run of `run.repeats` cycles under `nn.scan`; its routing per layer, in layer order."""
    kinds = tuple(scan.layer_kind(c, run.layer(q, 0)) for q in range(run.period))
    replay = None
    if replay_BxTxMxk is not None and any(moe for moe, _ in kinds):
        m_of = {i: m for m, i in enumerate(c.moe_layers)}
        idx_RxQ = [[m_of[run.layer(q, j)] for q in range(run.period) if kinds[q][0]]
                   for j in range(run.repeats)]
        replay = jnp.moveaxis(replay_BxTxMxk[:, :, jnp.asarray(idx_RxQ)], 2, 0)  # [R,B,T,Q,k]
    body = nn.scan(Cycle, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast if replay is None else 0, nn.broadcast, nn.broadcast,
                            nn.broadcast),
                   length=run.repeats, metadata_params={nn.PARTITION_NAME: "layers"})
    x, routings = body(c, kinds, name=run.name)(x, replay, positions_BxT, segments_BxT,
                                                 weights_BxT)
    per_layer = []  # repeat-major: layer order
    for j in range(run.repeats):
        for logits, experts, stats, own in routings:
            per_layer.append((logits[j], experts[j], {k: v[j] for k, v in stats.items()},
                              own[j]))
    return x, per_layer


class Transformer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxT, positions_BxT, segments_BxT, replay_BxTxMxk, cache,
                 cache_mask_BxS, return_logits: bool, weights_BxT=None):
        c = self.config
        embed = Embed(c, name="embed")
        x = _constrain(embed(tokens_BxT))
        new_cache, routings = {}, []
        for run in scan.runs(c):
            if run.repeats > 1:
                x, run_routing = _scanned_run(c, run, x, replay_BxTxMxk, positions_BxT,
                                              segments_BxT, weights_BxT)
                routings += run_routing
                continue
            i, m = run.start, len(routings)
            moe = c.is_moe_layer(i)
            replay = replay_BxTxMxk[:, :, m] if (moe and replay_BxTxMxk is not None) else None
            layer_cache = None if cache is None else cache[f"layers_{i}"]
            block = nn.remat(Block) if c.remat else Block
            linear = c.layer_type(i) == "linear_attention"
            x, layer_cache, routing = block(c, moe, linear, name=f"layers_{i}")(
                x, positions_BxT, segments_BxT, replay, layer_cache, cache_mask_BxS, weights_BxT
            )
            x = _constrain(x)
            if cache is not None:
                new_cache[f"layers_{i}"] = layer_cache
            if routing is not None:
                routings.append(routing)
        logits_list, experts_list, stats_list, own_list = (
            [r[k] for r in routings] for k in range(4))
        hidden = rms_norm(c, "final_norm")(x)
        logits = None
        if return_logits:
            if c.tie_embeddings:
                logits = embed.attend(hidden)
            else:
                # fp32 logits straight from the product, as `Embed.attend` gives them
                logits = Dense(c.vocab_size, ("embed", "vocab"), std=c.init_std, dtype=c.dtype,
                               param_dtype=c.param_dtype, out_dtype=jnp.float32,
                               name="lm_head")(hidden)
        return hidden, logits, logits_list, experts_list, own_list, stats_list, (
            new_cache if cache is not None else None)


def _check_shape(name: str, x: jax.Array | None, shape: tuple[int, ...]) -> None:
    if x is not None and tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")


def forward(
    config: ModelConfig,
    params: dict,
    tokens_BxT: jax.Array,
    *,
    positions_BxT: jax.Array | None = None,
    attention_mask_BxT: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
    routed_experts_BxTxMxk: jax.Array | None = None,
    token_weights_BxT: jax.Array | None = None,
    cache: dict | None = None,
    cache_mask_BxS: jax.Array | None = None,
    return_hidden: bool = False,
    return_logits: bool = True,
    deterministic: bool = True,
) -> ModelOutput:
    """Run the model on tokens_BxT (int).

    positions_BxT: default arange(T) in every row. attention_mask_BxT: True = real token; keys
    that are False are never attended to (and are excluded from the aux losses).
    segment_ids_BxT: several sequences packed in a row: a query attends only to keys of its
    own segment id (or of its group's shared prefix, `attention.PREFIX_STRIDE`); id 0 marks
    padding (as attention_mask False). Give positions_BxT that restart at each segment (a
    prefix's members continue its positions). Not with a cache.
    token_weights_BxT: each token's weight in the aux losses (default 1 on real tokens): a
    shared prefix stands for as many tokens as it has members.
    routed_experts_BxTxMxk: router replay, expert ids per token and MoE layer; a token whose row
    holds the sentinel -1 routes normally. cache (from `init_cache`) with cache_mask_BxS
    (True = slot holds a real earlier token of the row): the T new tokens are written at slots
    positions_BxT (padding tokens are not written) and each query at position p attends to
    valid slots s <= p (the slots written now count as valid); the updated cache is returned.
    deterministic: Qwen3-MoE has no dropout (HF attention_dropout = 0), so the output is the
    same either way; the flag exists for callers written against a generic policy interface.
    """
    del deterministic  # no stochastic layers in this architecture (see docstring)
    tokens_BxT = jnp.asarray(tokens_BxT)
    if tokens_BxT.ndim != 2:
        raise ValueError(f"tokens_BxT must be [B, T], got shape {tokens_BxT.shape}")
    b, t = tokens_BxT.shape
    if positions_BxT is None:
        positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids_BxT is not None:
        if attention_mask_BxT is not None or cache is not None:
            raise ValueError("segment_ids_BxT replaces attention_mask_BxT (id 0 = padding) and "
                             "cannot be used with a cache")
        segments_BxT = jnp.asarray(segment_ids_BxT).astype(jnp.int32)
    elif attention_mask_BxT is None:
        segments_BxT = jnp.ones((b, t), jnp.int32)
    else:
        segments_BxT = jnp.asarray(attention_mask_BxT).astype(bool).astype(jnp.int32)
    _check_shape("positions_BxT", positions_BxT, (b, t))
    _check_shape("attention_mask_BxT / segment_ids_BxT", segments_BxT, (b, t))
    _check_shape("token_weights_BxT", token_weights_BxT, (b, t))
    _check_shape("routed_experts_BxTxMxk", routed_experts_BxTxMxk,
                 (b, t, config.n_moe_layers, config.top_k))
    if cache is not None:
        if config.scan_layers:
            raise ValueError("forward(cache=...) needs the per-layer layout (scan_layers=False): "
                             "the engine reads the weights per layer (models.scan.unstack)")
        if cache_mask_BxS is None:
            raise ValueError("forward(cache=...) needs cache_mask_BxS (True = slot holds a "
                             "real earlier token of the row; all False for an empty cache)")
        missing = [f"layers_{i}" for i in range(config.n_layers) if f"layers_{i}" not in cache]
        if missing:
            raise ValueError(f"cache lacks entries for {missing}; build it with init_cache")
        s = cache_length(cache)
        if s is not None:
            _check_shape("cache_mask_BxS", cache_mask_BxS, (b, s))
        cache_mask_BxS = jnp.asarray(cache_mask_BxS).astype(bool)
    hidden, logits, r_logits, experts, own, stats, new_cache = Transformer(config).apply(
        {"params": params}, tokens_BxT, jnp.asarray(positions_BxT), segments_BxT,
        routed_experts_BxTxMxk, cache, cache_mask_BxS, return_logits,
        None if token_weights_BxT is None else jnp.asarray(token_weights_BxT, jnp.float32),
    )
    if experts:
        routed, own_routed = jnp.stack(experts, axis=2), jnp.stack(own, axis=2)
        mean = {k: jnp.mean(jnp.stack([s[k] for s in stats])) for k in stats[0]}
    else:
        routed = own_routed = jnp.zeros((b, t, 0, config.top_k), jnp.int32)
        mean = {k: jnp.zeros((), jnp.float32) for k in
                ("load_balance_loss", "z_loss", "dropped_frac")}
    aux = config.aux_loss_coef * mean["load_balance_loss"] + config.z_loss_coef * mean["z_loss"]
    return ModelOutput(
        logits=logits,
        hidden=hidden if return_hidden else None,
        router_logits=tuple(r_logits),
        routed_experts=routed,
        own_experts=own_routed,
        aux_loss=aux,
        metrics={f"moe/{k}": v for k, v in mean.items()},
        cache=new_cache,
    )


def _dummy_tokens() -> jax.Array:
    return jnp.zeros((1, 1), jnp.int32)


def init_boxed(config: ModelConfig, rng: jax.Array) -> dict:
    """Parameters with their logical-axis metadata (`nn.LogicallyPartitioned` leaves)."""
    t = _dummy_tokens()
    return Transformer(config).init(
        rng, t, jnp.zeros_like(t), jnp.ones(t.shape, bool), None, None, None, True
    )["params"]


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: ModelConfig, rng: jax.Array) -> dict:
    """A plain parameter pytree (see the package docstring for its layout). One program: run op
    by op, a model's initialisation compiles each of its hundreds of ops on its own."""
    return nn.meta.unbox(init_boxed(config, rng))


def lm_head_kernel(config: ModelConfig, params: dict, dtype: Any = None) -> jax.Array:
    """The [D, V] LM-head kernel (the embedding transposed when tied), dequantised if FP8,
    so callers can compute log-probs from `hidden` in vocabulary or sequence chunks."""
    dtype = dtype or config.dtype
    if config.tie_embeddings:
        return quant.maybe_dequant(params["embed"]["embedding"], dtype).T
    return quant.maybe_dequant(params["lm_head"]["kernel"], dtype)


def cache_length(cache: dict) -> int | None:
    """S, the slots of a cache from `init_cache` (either attention kind; None when every layer
    is linear attention, whose cache has no slots)."""
    slot_axes = {**gqa.CACHE_SLOT_AXES, **mla.CACHE_SLOT_AXES}
    for layer in cache.values():
        for name, array in layer.items():
            if slot_axes.get(name) is not None:
                return array.shape[slot_axes[name]]
    return None


def kv_cache_dtype(config: ModelConfig) -> Any:
    """The dtype of the keys and values a cache holds: the compute dtype, but fp32 for a 2-byte
    one on CPU. XLA:CPU has no bf16 scatter: each cache write converted the layer's whole cache
    to fp32 and back, every decode step (a fifth of SmolLM2-135M's bf16 generation). Keys and
    values computed in bf16 are exact in fp32, and attention reads them without a conversion
    (its products take bf16 inputs with fp32 sums either way)."""
    dtype = jnp.dtype(config.dtype)
    if jax.default_backend() == "cpu" and jnp.issubdtype(dtype, jnp.floating) \
            and dtype.itemsize == 2:
        return jnp.float32
    return dtype


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> dict:
    """An empty KV cache: {"layers_{i}": {"k": [B, K, A, S], "v": [B, K, S, A]}}, zeros.
    Slot s holds the token at position s; validity is the caller's `cache_mask_BxS`. Kv-head
    major, the keys with the slots minor: a decode step's scores and weighted values are then
    [G, A] x [A, S] and [G, S] x [S, A] products with no transpose (`attention.attend_keys`).
    MLA (`attention == "mla"`): {"latent": [B, S, C], "k_rope": [B, S, R]} per layer, the
    compressed latent and rope key (`mla`): (C + R) * bytes-per-number per token and layer.
    A linear_attention layer holds its conv windows and recurrent state instead, of a size
    independent of max_len (`gated_deltanet.cache_shapes`; the state float32)."""
    attn_dtype = dtype or kv_cache_dtype(config)
    dtype = dtype or config.dtype
    linear = {name: (shape, dt or dtype)
              for name, (shape, dt) in gated_deltanet.cache_shapes(config, batch).items()}
    shapes = (latent_cache_shapes if config.attention == "mla" else gqa.cache_shapes)(
        config, batch, max_len)
    attn = {name: (shape, attn_dtype) for name, shape in shapes.items()}
    return {f"layers_{i}": {name: jnp.zeros(shape, dt) for name, (shape, dt) in (
        linear if config.layer_type(i) == "linear_attention" else attn).items()}
        for i in range(config.n_layers)}


def cache_slot_axes(config: ModelConfig) -> tuple[tuple[str, tuple[tuple[str, int | None], ...]],
                                                  ...]:
    """Per layer of `init_cache`, each cache entry's axis of the S slots, as its token mixer
    declares it (`CACHE_SLOT_AXES` of `gqa`, `mla`, `gated_deltanet`); None for an entry of a
    fixed size (a linear layer's conv windows and state). Nested tuples (hashable: a static
    argument of a jitted function)."""
    def axes(i):
        if config.layer_type(i) == "linear_attention":
            return gated_deltanet.CACHE_SLOT_AXES
        return mla.CACHE_SLOT_AXES if config.attention == "mla" else gqa.CACHE_SLOT_AXES

    return tuple((f"layers_{i}", tuple(axes(i).items())) for i in range(config.n_layers))
