"""DeepSeek-V3 multi-head latent attention (MLA), as transformers' `DeepseekV3Attention`.

Per token (H heads, C = kv_lora_rank, R = qk_rope_head_dim, P = qk_nope_head_dim, Dv =
v_head_dim):
- queries: x -> q_proj [H * (P + R)], or through a low rank, x -> q_a_proj [q_lora_rank] ->
  RMSNorm -> q_b_proj [H * (P + R)]; each head's last R dims get RoPE.
- keys and values from one compressed latent: x -> kv_a_proj [C + R]; the first C dims, after
  an RMSNorm, are the latent, the last R one RoPE key shared by all heads. kv_b_proj maps the
  latent to each head's P key dims and Dv value dims; a head's key is [its P dims, the shared
  rope key].
- softmax scale 1 / sqrt(P + R), times mscale^2 under YaRN with mscale_all_dim (`rope`).
The RoPE layout is `ModelConfig.rope_interleave` (DeepSeek checkpoints: interleaved pairs).

The KV cache holds the latent and the rotated rope key per token, not the heads' keys and
values: (C + R) numbers per token and layer against H * (P + R + Dv) for the expanded heads
(DeepSeek-V3: 512 + 64 = 576 against 128 * 320 = 40960, 1152 against 81920 bytes in bf16)
(`init_cache`'s "latent" and "k_rope"). A pass of several tokens expands the latents it reads
through kv_b_proj. A decode step (one new token per row) absorbs kv_b_proj instead, as
DeepSeek-V2 describes: each head's query goes into the latent space through the key half of
kv_b_proj, attends over the cached [latent, rope key] as one shared key and value head (MQA, key
dims C + R, value dims C), and its latent output comes out through the value half. A step then
reads the cache once and costs H * S * (2C + R) multiply-adds per token against
S * C * H * (P + Dv) for expanding S latents (DeepSeek-V3: under 1/100 of that).

Logical axes of the kernels (`espo_jax.sharding`): q_a_proj ("embed", "q_lora"), q_b_proj
("q_lora", "heads"), kv_a_proj ("embed", "kv_lora"), kv_b_proj ("kv_lora", "heads"), o_proj
("heads", "embed"), q_proj ("embed", "heads").
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from espo_jax.models import quant
from espo_jax.models.attention import attend, cache_view
from espo_jax.models.config import ModelConfig
from espo_jax.models.layers import Axes, RMSNorm, dense, weight
from espo_jax.models.rope import rotate, softmax_scale_factor

# transformers builds the q_a and kv_a RMSNorms with their default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


# the axis of the S cache slots in each entry of a layer's cache (`latent_cache_shapes`)
CACHE_SLOT_AXES = {"latent": 1, "k_rope": 1}


def latent_cache_shapes(config: ModelConfig, batch: int, max_len: int) -> dict[str, tuple]:
    """Shapes of one layer's MLA cache: the normed latent [B, S, C] and the rope key [B, S, R]."""
    return {"latent": (batch, max_len, config.kv_lora_rank),
            "k_rope": (batch, max_len, config.qk_rope_head_dim)}


def _write(cache_BxSxN: jax.Array, new_BxTxN: jax.Array, slots_BxT: jax.Array) -> jax.Array:
    """Row b's T new entries at slots `slots_BxT[b]`; slots >= S are dropped."""
    b_idx = jnp.arange(new_BxTxN.shape[0])[:, None]
    return cache_BxSxN.at[b_idx, slots_BxT].set(new_BxTxN.astype(cache_BxSxN.dtype),
                                                 mode="drop")


class _Kernel(nn.Module):
    """A `layers.Dense` kernel read without its product (the same parameter: name, shape, axes,
    initialiser), in `dtype`, dequantised if FP8."""

    shape: tuple[int, int]
    axes: Axes
    std: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self) -> jax.Array:
        kernel = weight(self, "kernel", nn.initializers.normal(self.std), self.shape, self.axes,
                        self.param_dtype)
        return quant.maybe_dequant(kernel, self.dtype)


def _product(spec: str, x: jax.Array, w: jax.Array, dtype: Any) -> jax.Array:
    """einsum(spec, x, w) in `dtype`, summed in fp32 (as `layers.matmul`)."""
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(dtype)


class LatentAttention(nn.Module):
    """MLA with a causal, segment-aware mask as `gqa.Attention` (same arguments, same cache
    contract: slot s holds position s; validity is the caller's `cache_mask_BxS`). `absorb`
    False expands the cached latents in decode steps too, as transformers does (the same
    function, other rounding; `bench mla_decode` times both)."""

    config: ModelConfig
    absorb: bool = True

    @nn.compact
    def __call__(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        segments_BxT: jax.Array,
        cache: dict | None = None,
        cache_mask_BxS: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None]:
        c = self.config
        b, t, _ = x_BxTxD.shape
        h, p, r, dv, lat = (c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                            c.kv_lora_rank)
        valid_BxT = segments_BxT > 0
        if c.q_lora_rank:
            q = dense(c, c.q_lora_rank, ("embed", "q_lora"), "q_a_proj")(x_BxTxD)
            q = RMSNorm(LATENT_NORM_EPS, c.dtype, c.param_dtype, name="q_a_norm")(q)
            q = dense(c, h * (p + r), ("q_lora", "heads"), "q_b_proj")(q)
        else:
            q = dense(c, h * (p + r), ("embed", "heads"), "q_proj")(x_BxTxD)
        q_BxTxHxQ = q.reshape(b, t, h, p + r)
        q_BxTxHxQ = jnp.concatenate(
            [q_BxTxHxQ[..., :p], rotate(c, q_BxTxHxQ[..., p:], positions_BxT)], axis=-1)
        kv = dense(c, lat + r, ("embed", "kv_lora"), "kv_a_proj")(x_BxTxD)
        latent_BxTxC = RMSNorm(LATENT_NORM_EPS, c.dtype, c.param_dtype,
                               name="kv_a_norm")(kv[..., :lat])
        k_rope_BxTxR = rotate(c, kv[..., None, lat:], positions_BxT)[:, :, 0]

        new_cache = None
        if cache is None:
            key_pos_BxS, key_valid_BxS, key_segments_BxS = positions_BxT, valid_BxT, segments_BxT
        else:
            slots_BxT, key_pos_BxS, key_valid_BxS = cache_view(
                positions_BxT, valid_BxT, cache_mask_BxS, cache["latent"].shape[1])
            new_cache = {"latent": _write(cache["latent"], latent_BxTxC, slots_BxT),
                         "k_rope": _write(cache["k_rope"], k_rope_BxTxR, slots_BxT)}
            # as held (`kv_cache_dtype`: wider than the compute dtype on CPU), else in it
            read = jnp.promote_types(cache["latent"].dtype, c.dtype)
            latent_BxTxC = new_cache["latent"].astype(read)
            k_rope_BxTxR = new_cache["k_rope"].astype(read)
            key_segments_BxS = None  # a cache row holds one sequence

        n_keys = latent_BxTxC.shape[1]
        scale = softmax_scale_factor(c)
        keys = dict(keys_BxKxAxS=None, key_pos_BxS=key_pos_BxS, key_valid_BxS=key_valid_BxS,
                    key_segments_BxS=key_segments_BxS)
        if cache is not None and t == 1 and self.absorb:  # a decode step (module doc)
            w_CxHxF = _Kernel((lat, h * (p + dv)), ("kv_lora", "heads"), c.init_std, c.dtype,
                              c.param_dtype, name="kv_b_proj")().reshape(lat, h, p + dv)
            q_lat_BxTxHxC = _product("bthp,chp->bthc", q_BxTxHxQ[..., :p], w_CxHxF[..., :p],
                                     c.dtype)
            # attend_keys scales by 1 / sqrt(C + R); MLA's scale is 1 / sqrt(P + R) (YaRN's
            # factor on top)
            factor = scale * ((lat + r) / (p + r)) ** 0.5
            q_BxTxHxA = jnp.concatenate([q_lat_BxTxHxC, q_BxTxHxQ[..., p:]], axis=-1)
            q_BxTxHxA = q_BxTxHxA * jnp.asarray(factor, q_BxTxHxA.dtype)
            out_BxTx1xHxC = attend(
                c, q_BxTxHxA[:, :, None], positions_BxT, segments_BxT, False,
                keys_BxKxSxA=jnp.concatenate([latent_BxTxC, k_rope_BxTxR], axis=-1)[:, None],
                values_BxKxSxA=latent_BxTxC[:, None], **keys)
            out_BxTxHxV = _product("bthc,chv->bthv", out_BxTx1xHxC[:, :, 0], w_CxHxF[..., p:],
                                   c.dtype)
        else:
            kv_b = dense(c, h * (p + dv), ("kv_lora", "heads"), "kv_b_proj")
            kv_BxSxHxF = kv_b(latent_BxTxC).reshape(b, n_keys, h, p + dv)
            k_rope_BxSxHxR = jnp.broadcast_to(k_rope_BxTxR[:, :, None, :], (b, n_keys, h, r))
            keys_BxSxHxQ = jnp.concatenate([kv_BxSxHxF[..., :p], k_rope_BxSxHxR], axis=-1)
            if scale != 1.0:  # attend_keys scales by 1 / sqrt(P + R); the YaRN factor on top
                q_BxTxHxQ = q_BxTxHxQ * jnp.asarray(scale, q_BxTxHxQ.dtype)
            out_BxTxHxV = attend(
                c, q_BxTxHxQ[:, :, :, None], positions_BxT, segments_BxT, cache is None,
                keys_BxKxSxA=jnp.swapaxes(keys_BxSxHxQ, 1, 2),
                values_BxKxSxA=jnp.swapaxes(kv_BxSxHxF[..., p:], 1, 2), **keys)
        out = dense(c, c.d_model, ("heads", "embed"), "o_proj")(out_BxTxHxV.reshape(b, t, h * dv))
        return out, new_cache
