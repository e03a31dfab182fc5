"""The attention math the token mixers share (`gqa.Attention`, `mla.LatentAttention`): the KV
cache's writes and view, which keys a query sees (causal, valid, its segment or its group's
shared prefix: `PREFIX_STRIDE`), the softmax over them in espo_jax's own einsums, in query
chunks or causal blocks, or through `jax.nn.dot_product_attention`, chosen by `attend`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from espo_jax.models.config import ModelConfig


def write_cache(
    cache_BxKxSxA: jax.Array, new_BxTxKxA: jax.Array, slots_BxT: jax.Array
) -> jax.Array:
    """Write row b's T new entries at cache slots `slots_BxT[b]` (of every kv head); slots >= S
    are dropped."""
    b, _, k, _ = new_BxTxKxA.shape
    b_idx, k_idx = jnp.arange(b)[:, None, None], jnp.arange(k)[None, None, :]
    return cache_BxKxSxA.at[b_idx, k_idx, slots_BxT[:, :, None]].set(
        new_BxTxKxA.astype(cache_BxKxSxA.dtype), mode="drop"
    )


def cache_view(positions_BxT: jax.Array, valid_BxT: jax.Array, cache_mask_BxS: jax.Array,
               s: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What a cached forward of T new tokens reads, for every attention kind: (slots_BxT, the
    slots the tokens are written at, S for padding, which `mode="drop"` writes drop;
    key_pos_BxS, slot s holds position s; key_valid_BxS, the caller's valid slots and those
    written now)."""
    b = positions_BxT.shape[0]
    slots_BxT = jnp.where(valid_BxT, positions_BxT, s)
    written_BxS = jnp.zeros((b, s), bool).at[jnp.arange(b)[:, None], slots_BxT].set(
        True, mode="drop")
    return slots_BxT, jnp.broadcast_to(jnp.arange(s), (b, s)), cache_mask_BxS | written_BxS


def write_cache_keys(
    cache_BxKxAxS: jax.Array, new_BxTxKxA: jax.Array, slots_BxT: jax.Array
) -> jax.Array:
    """`write_cache` for the keys' [B, K, A, S] layout (slots the minor axis)."""
    b, _, k, _ = new_BxTxKxA.shape
    b_idx, k_idx = jnp.arange(b)[:, None, None], jnp.arange(k)[None, None, :]
    return cache_BxKxAxS.at[b_idx, k_idx, :, slots_BxT[:, :, None]].set(
        new_BxTxKxA.astype(cache_BxKxAxS.dtype), mode="drop"
    )


# Segment ids of a shared prefix and its continuations: g * PREFIX_STRIDE + m (g >= 1) is
# member m of group g, m = 0 the prefix (e.g. a prompt, once) that members 1, 2, ... (its
# responses) all attend to; ids below PREFIX_STRIDE are plain sequences.
PREFIX_STRIDE = 1 << 16


def segment_visible(query_seg: jax.Array, key_seg: jax.Array) -> jax.Array:
    """Whether a key of segment `key_seg` may be attended to from segment `query_seg` (the
    positions permitting): its own segment, or its group's shared prefix (`PREFIX_STRIDE`)."""
    prefix = (key_seg % PREFIX_STRIDE == 0) & (key_seg > 0)
    return (key_seg == query_seg) | (prefix & (key_seg // PREFIX_STRIDE
                                               == query_seg // PREFIX_STRIDE))


def attend_keys(q_BxTxKxGxA: jax.Array, positions_BxT: jax.Array,
                segments_BxT: jax.Array | None = None, *, keys_BxKxSxA: jax.Array | None = None,
                keys_BxKxAxS: jax.Array | None = None, values_BxKxSxA: jax.Array,
                key_pos_BxS: jax.Array, key_valid_BxS: jax.Array,
                key_segments_BxS: jax.Array | None = None, dtype: Any) -> jax.Array:
    """Softmax attention of queries at `positions_BxT` over the keys at positions <= theirs
    that are valid (and, given segment ids, of the query's own segment or its shared prefix:
    packed rows, `segment_visible`); scores
    and softmax in fp32. Materialises the [B, K, G, T, S] scores. Keys and values are kv-head
    major; the keys either [B, K, S, A] or, as the KV cache holds them, [B, K, A, S]
    (`init_cache`; exactly one of the two is given)."""
    if (keys_BxKxSxA is None) == (keys_BxKxAxS is None):
        raise ValueError("give exactly one of keys_BxKxSxA and keys_BxKxAxS")
    b, t, kv, g, a = q_BxTxKxGxA.shape
    # Queries kv-head major, a head's G*T query rows as one matrix: [B, K, G*T, A] x [B, K, S, A]
    # products (at the default update's shape, fwd + bwd of one layer's attention with Eigen's
    # dots 77-89 ms against 107-117 ms for the [B, T, K, G, A] einsum).
    q_BxKxQxA = jnp.moveaxis(q_BxTxKxGxA, 1, 3).reshape(b, kv, g * t, a)
    mask_BxTxS = (key_pos_BxS[:, None, :] <= positions_BxT[:, :, None]) & key_valid_BxS[
        :, None, :
    ]
    if key_segments_BxS is not None:
        mask_BxTxS &= segment_visible(segments_BxT[:, :, None], key_segments_BxS[:, None, :])
    if t > 1:
        if keys_BxKxSxA is None:
            keys_BxKxSxA = jnp.swapaxes(keys_BxKxAxS, 2, 3)
        out_BxKxQxA = softmax_attention(q_BxKxQxA, keys_BxKxSxA, values_BxKxSxA,
                                        mask_BxTxS[:, None, None], g, dtype)
        return jnp.moveaxis(out_BxKxQxA.reshape(b, kv, g, t, -1), 3, 1)
    # A decode step: with the cache's [A, S] keys both products are plain batched matmuls,
    # [G, A] x [A, S] and [G, S] x [S, A] per slot and kv head. A 32-slot decode step of the
    # peers model, scores + weighted values + o_proj per layer: 133 us with [S, A] keys and
    # the values as a fused broadcast sum, 69 us so.
    keys, minor = (keys_BxKxSxA, "sa") if keys_BxKxAxS is None else (keys_BxKxAxS, "as")
    e, rowsum = _masked_softmax(q_BxKxQxA, keys, mask_BxTxS[:, None, None], g, minor)
    out_BxKxGxA = jnp.einsum("bkgs,bksa->bkga", (e / rowsum).astype(dtype)[:, :, :, 0],
                             values_BxKxSxA, preferred_element_type=jnp.float32).astype(dtype)
    return out_BxKxGxA[:, None]


def _masked_softmax(q_BxKxQxA, keys, mask, g: int, keys_layout: str = "sa"):
    """(exp(scores - row max) [B, K, G, T, S] where `mask` (0 elsewhere), their row sums):
    scores q.k / sqrt(A) in fp32, the keys [B, K, S, A] (`keys_layout` "sa") or [B, K, A, S]
    ("as"). A finite minimum rather than -inf for the masked scores: a query with no valid
    key (a padding query) gets a uniform, finite distribution instead of NaN; its output is
    never used."""
    b, kv, q, a = q_BxKxQxA.shape
    scores = jnp.einsum(f"bkqa,bk{keys_layout}->bkqs", q_BxKxQxA, keys,
                        preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, g, q // g, -1) * (a ** -0.5)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    return e, jnp.sum(e, axis=-1, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def softmax_attention(q_BxKxQxA, keys_BxKxSxA, values_BxKxSxA, mask, g: int, dtype):
    """softmax(q.k / sqrt(A) where `mask`) . v for a kv head's Q = G*T query rows, with a
    hand-written backward. Neither pass materialises the probabilities: the forward divides
    the [Q, A] output by the row sums instead of the [Q, S] weights, and the backward takes
    sum_s p dp from the output (sum_a dout * out), so the [Q, S] tensors are passed over
    twice forward and once backward (autodiff: five and three; the default update's shape,
    fwd + bwd of one layer's attention 39.9 -> 33.5 ms on a 2-core Intel Xeon)."""
    return _softmax_attention_fwd(q_BxKxQxA, keys_BxKxSxA, values_BxKxSxA, mask, g, dtype)[0]


def _softmax_attention_fwd(q_BxKxQxA, keys_BxKxSxA, values_BxKxSxA, mask, g, dtype):
    b, kv, q, _ = q_BxKxQxA.shape
    e, rowsum = _masked_softmax(q_BxKxQxA, keys_BxKxSxA, mask, g)
    e_BxKxQxS, l_BxKxQx1 = e.reshape(b, kv, q, -1), rowsum.reshape(b, kv, q, 1)
    out = (jnp.einsum("bkqs,bksa->bkqa", e_BxKxQxS.astype(dtype), values_BxKxSxA,
                      preferred_element_type=jnp.float32) / l_BxKxQx1).astype(dtype)
    return out, (q_BxKxQxA, keys_BxKxSxA, values_BxKxSxA, mask, e_BxKxQxS, l_BxKxQx1, out)


def _softmax_attention_bwd(g, dtype, residuals, dout_BxKxQxA):
    """With p = e / l (l the row sums): dv = p^T dout, dp = dout v^T, ds = p (dp - sum_s p dp)
    / sqrt(A) and sum_s p dp = sum_a dout * out. Masked scores have e = 0, hence ds = 0; a row
    with no valid key has a uniform p, constant in q and k: its ds is zeroed through dout."""
    q, k, v, mask, e, rowsum, out = residuals
    b, kv, nq, _ = e.shape
    dout_l = dout_BxKxQxA / rowsum
    dv = jnp.einsum("bkqs,bkqa->bksa", e.astype(dtype), dout_l.astype(dtype))
    sees_BxKxQx1 = jnp.broadcast_to(jnp.any(mask, axis=-1), (b, kv, g, nq // g)).reshape(
        b, kv, nq, 1)
    dout_l = jnp.where(sees_BxKxQx1, dout_l, 0)
    dp_l = jnp.einsum("bkqa,bksa->bkqs", dout_l.astype(dtype), v,
                      preferred_element_type=jnp.float32)
    pdp = jnp.sum(dout_l * out, axis=-1, keepdims=True)
    ds = (e * (dp_l - pdp) * (q.shape[-1] ** -0.5)).astype(dtype)
    dq = jnp.einsum("bkqs,bksa->bkqa", ds, k)
    dk = jnp.einsum("bkqs,bkqa->bksa", ds, q)
    return dq, dk, dv, None


softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


def chunked(attend: Callable[..., jax.Array], q_BxTxKxGxA: jax.Array,
            positions_BxT: jax.Array, segments_BxT: jax.Array, chunk: int) -> jax.Array:
    """`attend` over query chunks of `chunk` tokens, one after the other (`lax.map`), each
    under `jax.checkpoint`: the forward holds one chunk's [B, K, G, chunk, S] scores at a time
    and the backward recomputes them, so attention memory is O(chunk * S) instead of O(T * S).
    Each query row's softmax still spans all keys, so the result is the full attention's (up to
    float summation order). T is padded to a multiple of `chunk` with queries at position -1
    (no key visible; their rows are dropped)."""
    b, t = positions_BxT.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    q = jnp.pad(q_BxTxKxGxA, ((0, 0), (0, pad)) + ((0, 0),) * 3)
    pos = jnp.pad(positions_BxT, ((0, 0), (0, pad)), constant_values=-1)
    seg = jnp.pad(segments_BxT, ((0, 0), (0, pad)))

    def per_chunk(x):
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda qps: jax.checkpoint(attend)(*qps),
                      (per_chunk(q), per_chunk(pos), per_chunk(seg)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, *out.shape[3:])[:, :t]


def causal_blocks(q_BxTxKxGxA: jax.Array, positions_BxT: jax.Array, segments_BxT: jax.Array,
                  *, keys_BxKxSxA: jax.Array, values_BxKxSxA: jax.Array, n: int,
                  dtype: Any) -> jax.Array:
    """`attend_keys` of a row over its own tokens (no cache; S == T) in `n` query blocks, the
    block of rows [lo, hi) reading only keys [0, hi). A key after its query in the row is never
    visible (a later position of the query's segment, or a later segment: another sequence), so
    the keys left out are masked ones; the result is the full attention's up to float summation
    order, for ~(n + 1) / 2n of the score work. Needs positions increasing along each segment."""
    t = q_BxTxKxGxA.shape[1]
    size = -(-t // n)
    outs = []
    for lo in range(0, t, size):
        hi = min(t, lo + size)
        outs.append(attend_keys(
            q_BxTxKxGxA[:, lo:hi], positions_BxT[:, lo:hi], segments_BxT[:, lo:hi],
            keys_BxKxSxA=keys_BxKxSxA[:, :, :hi], values_BxKxSxA=values_BxKxSxA[:, :, :hi],
            key_pos_BxS=positions_BxT[:, :hi], key_valid_BxS=segments_BxT[:, :hi] > 0,
            key_segments_BxS=segments_BxT[:, :hi], dtype=dtype))
    return jnp.concatenate(outs, axis=1)


def dot_product_attention(config: ModelConfig, q_BxTxKxGxA: jax.Array, positions_BxT: jax.Array,
                          segments_BxT: jax.Array, *, keys_BxKxSxA: jax.Array,
                          values_BxKxSxA: jax.Array, **_) -> jax.Array:
    """`attend_keys` of a pass without a cache (S == T) through `jax.nn.dot_product_attention`
    (`config.attention_impl` "dpa": JAX picks the implementation; "cudnn": cuDNN's fused kernel),
    with the same visibility as a boolean [B, 1, T, S] mask. Its query head h = k * G + g is
    `q_BxTxKxGxA[:, :, k, g]`, as `jax.nn.dot_product_attention` groups heads; scale 1/sqrt(A)."""
    b, t, kv, g, a = q_BxTxKxGxA.shape
    mask_BxTxS = ((positions_BxT[:, None, :] <= positions_BxT[:, :, None])
                  & (segments_BxT[:, None, :] > 0)
                  & segment_visible(segments_BxT[:, :, None], segments_BxT[:, None, :]))
    dtype = jnp.dtype(config.dtype)
    out_BxTxHxA = jax.nn.dot_product_attention(
        q_BxTxKxGxA.reshape(b, t, kv * g, a).astype(dtype),
        jnp.swapaxes(keys_BxKxSxA, 1, 2).astype(dtype),
        jnp.swapaxes(values_BxKxSxA, 1, 2).astype(dtype), mask=mask_BxTxS[:, None],
        implementation="cudnn" if config.attention_impl == "cudnn" else None)
    return out_BxTxHxA.reshape(b, t, kv, g, a)


def attend(config: ModelConfig, q_BxTxKxGxA: jax.Array, positions_BxT: jax.Array,
           segments_BxT: jax.Array, no_cache: bool, **keys: jax.Array | None) -> jax.Array:
    """`attend_keys` (keyword arguments `keys`) the way `config` asks: in query chunks
    (`attention_chunk`), in causal blocks (`causal_blocks`, a pass without a cache), through
    `jax.nn.dot_product_attention` (`attention_impl`, a pass without a cache), or at once."""
    c = config
    t = q_BxTxKxGxA.shape[1]
    if no_cache and c.attention_impl != "xla":
        return dot_product_attention(c, q_BxTxKxGxA, positions_BxT, segments_BxT, **keys)
    attend_fn = functools.partial(attend_keys, **keys, dtype=c.dtype)
    if c.attention_chunk and t > c.attention_chunk:
        return chunked(attend_fn, q_BxTxKxGxA, positions_BxT, segments_BxT, c.attention_chunk)
    if no_cache and c.causal_blocks > 1 and t >= 2 * c.causal_blocks:
        return causal_blocks(q_BxTxKxGxA, positions_BxT, segments_BxT,
                             keys_BxKxSxA=keys["keys_BxKxSxA"],
                             values_BxKxSxA=keys["values_BxKxSxA"], n=c.causal_blocks,
                             dtype=c.dtype)
    return attend_fn(q_BxTxKxGxA, positions_BxT, segments_BxT)


