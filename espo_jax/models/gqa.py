"""Grouped-query attention (Qwen3, Llama, GLM-4.5, the full-attention layers of Qwen3-Next and
Qwen3.5): q/k norm, q/k/v bias, RoPE from `rope` over all or part of each head, an optional
output gate and KV cache; the attention itself is `attention.attend`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from espo_jax.models.attention import attend, cache_view, write_cache, write_cache_keys
from espo_jax.models.config import ModelConfig
from espo_jax.models.layers import dense, rms_norm
from espo_jax.models.rope import rotate

# the axis of the S cache slots in each entry of a layer's cache (`cache_shapes`)
CACHE_SLOT_AXES = {"k": 3, "v": 2}


def cache_shapes(config: ModelConfig, batch: int, max_len: int) -> dict[str, tuple[int, ...]]:
    """One layer's cache: keys [B, K, A, S] (slots minor: a decode step's scores are then a
    [G, A] x [A, S] product with no transpose, `attention.attend_keys`), values [B, K, S, A]."""
    return {"k": (batch, config.n_kv_heads, config.head_dim, max_len),
            "v": (batch, config.n_kv_heads, max_len, config.head_dim)}


class Attention(nn.Module):
    """Grouped-query attention (K kv heads shared by H/K query heads each), q/k RMSNorm per
    head, RoPE. A query at position p sees keys at positions <= p that are valid (segment id
    > 0) and, without a cache, of its own segment or its shared prefix (several sequences
    packed in one row, `segment_visible`)."""

    config: ModelConfig

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
        valid_BxT = segments_BxT > 0
        b, t, _ = x_BxTxD.shape
        h, kv, a = c.n_heads, c.n_kv_heads, c.head_dim
        gated = 2 if c.attn_output_gate else 1  # per head [query A, gate A] (Qwen3-Next)
        q = dense(c, h * a * gated, ("embed", "heads"), "q_proj", c.qkv_bias)(x_BxTxD)
        k = dense(c, kv * a, ("embed", "kv_heads"), "k_proj", c.qkv_bias)(x_BxTxD)
        v = dense(c, kv * a, ("embed", "kv_heads"), "v_proj", c.qkv_bias)(x_BxTxD)
        q_BxTxHxA, k_BxTxKxA = q.reshape(b, t, h, gated * a)[..., :a], k.reshape(b, t, kv, a)
        gate_BxTxHxA = q.reshape(b, t, h, gated * a)[..., a:] if gated == 2 else None
        v_BxTxKxA = v.reshape(b, t, kv, a)
        if c.qk_norm:
            q_BxTxHxA = rms_norm(c, "q_norm")(q_BxTxHxA)
            k_BxTxKxA = rms_norm(c, "k_norm")(k_BxTxKxA)
        q_BxTxHxA = rotate(c, q_BxTxHxA, positions_BxT, c.rotary_dim)
        k_BxTxKxA = rotate(c, k_BxTxKxA, positions_BxT, c.rotary_dim)

        new_cache = None
        if cache is None:
            keys_BxKxSxA, keys_BxKxAxS = jnp.swapaxes(k_BxTxKxA, 1, 2), None
            values_BxKxSxA = jnp.swapaxes(v_BxTxKxA, 1, 2)
            key_pos_BxS, key_valid_BxS = positions_BxT, valid_BxT
            key_segments_BxS = segments_BxT
        else:
            slots_BxT, key_pos_BxS, key_valid_BxS = cache_view(
                positions_BxT, valid_BxT, cache_mask_BxS, cache["v"].shape[2])
            new_cache = {"k": write_cache_keys(cache["k"], k_BxTxKxA, slots_BxT),
                         "v": write_cache(cache["v"], v_BxTxKxA, slots_BxT)}
            # as held (`kv_cache_dtype`: wider than the compute dtype on CPU), else in it
            read = jnp.promote_types(cache["k"].dtype, c.dtype)
            keys_BxKxSxA, keys_BxKxAxS = None, new_cache["k"].astype(read)
            if t > 1:  # a prefill: transposed once, not per chunk of queries
                keys_BxKxSxA, keys_BxKxAxS = jnp.swapaxes(keys_BxKxAxS, 2, 3), None
            values_BxKxSxA = new_cache["v"].astype(read)
            key_segments_BxS = None  # a cache row holds one sequence

        g = h // kv
        out_BxTxKxGxA = attend(c, q_BxTxHxA.reshape(b, t, kv, g, a), positions_BxT, segments_BxT,
                               cache is None, keys_BxKxSxA=keys_BxKxSxA,
                               keys_BxKxAxS=keys_BxKxAxS, values_BxKxSxA=values_BxKxSxA,
                               key_pos_BxS=key_pos_BxS, key_valid_BxS=key_valid_BxS,
                               key_segments_BxS=key_segments_BxS)
        out_BxTxHA = out_BxTxKxGxA.reshape(b, t, h * a)
        if gate_BxTxHxA is not None:
            out_BxTxHA = out_BxTxHA * jax.nn.sigmoid(gate_BxTxHxA.reshape(b, t, h * a))
        out = dense(c, c.d_model, ("heads", "embed"), "o_proj")(out_BxTxHA)
        return out, new_cache


