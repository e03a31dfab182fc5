"""Per-token log-probabilities of sampled tokens and full-vocabulary entropies, chunked.

An RL learner needs, at every position of every response, `log pi(y_t | y_<t)` of the sampled
token and the entropy `H_t = -sum_v pi(v) log pi(v)` of the whole next-token distribution (ESPO
groups and clips by it, RL-ZVP shapes advantages with it). With Qwen3's V = 151,936 an fp32
`[B, T, V]` tensor is 600 KB per token, so both functions here walk the sequence in chunks of
`chunk_size` positions with `lax.scan`, and the backward pass recomputes each chunk's softmax
instead of storing it (`jax.checkpoint` on the logits path, a closed-form gradient on the
hidden-state path): temporaries are `O(B * chunk_size * V)` whatever T is. The leftover
positions (T not a multiple of the chunk) form one smaller chunk; nothing is padded.

Shapes: B batch, T positions, V vocabulary, D model width.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

DEFAULT_CHUNK_SIZE = 128  # positions per chunk; B * 128 * V fp32 values live at once


def _logp_and_entropy(
    logits_BxCxV: jax.Array, targets_BxC: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """log pi(target) and entropy from one chunk of logits, in fp32.

    `-inf` logits (masked vocabulary entries) are clamped to the most negative finite float so
    that `p * log p` is exactly 0 there instead of `0 * -inf = nan`, forward and backward.
    """
    z = logits_BxCxV.astype(jnp.promote_types(logits_BxCxV.dtype, jnp.float32))
    z = jnp.maximum(z, jnp.finfo(z.dtype).min)
    logq = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
    entropy = -jnp.sum(jnp.exp(logq) * logq, axis=-1)
    # Out-of-range ids (e.g. -1 used as padding) are clipped: such positions must be masked.
    idx = jnp.clip(targets_BxC, 0, z.shape[-1] - 1)[..., None]
    logp = jnp.take_along_axis(logq, idx, axis=-1)[..., 0]
    return logp, entropy


def _map_over_time(
    chunk_fn: Callable[..., tuple[jax.Array, jax.Array]],
    seq_arrays: tuple[jax.Array, ...],
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Apply `chunk_fn` to consecutive time slices (axis 1) of `seq_arrays`; concat results."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T = seq_arrays[0].shape[:2]
    c = min(chunk_size, T)
    if c == 0:  # T == 0: nothing to compute
        empty = jnp.zeros((B, 0), jnp.float32)
        return empty, empty
    body = jax.checkpoint(chunk_fn)
    n_full = T // c

    def step(carry, i):
        sl = tuple(lax.dynamic_slice_in_dim(a, i * c, c, axis=1) for a in seq_arrays)
        return carry, body(*sl)

    _, (logp_NxBxC, ent_NxBxC) = lax.scan(step, None, jnp.arange(n_full))
    logp_BxT = jnp.moveaxis(logp_NxBxC, 0, 1).reshape(B, n_full * c)
    ent_BxT = jnp.moveaxis(ent_NxBxC, 0, 1).reshape(B, n_full * c)
    if n_full * c < T:
        tail_logp, tail_ent = body(*(a[:, n_full * c :] for a in seq_arrays))
        logp_BxT = jnp.concatenate([logp_BxT, tail_logp], axis=1)
        ent_BxT = jnp.concatenate([ent_BxT, tail_ent], axis=1)
    return logp_BxT, ent_BxT


def token_logprobs_and_entropy(
    logits_BxTxV: jax.Array,
    targets_BxT: jax.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target token and entropy of each position's distribution.

    logp[b, t] = z[b, t, y] - logsumexp_v z[b, t, v],   z = logits / temperature
    H[b, t]    = -sum_v softmax(z)[v] * log softmax(z)[v]

    Logits may be bf16; each chunk is upcast to fp32, so the fp32 copy never exceeds
    `[B, chunk_size, V]` (on GPU/TPU; XLA:CPU has no bf16 slicing, upcasts the whole operand
    and hoists that out of the loop, so on CPU pass fp32 logits or use `logprobs_from_hidden`).
    The backward writes the `[B, T, V]` gradient (in the logits' dtype) chunk by chunk.
    `targets_BxT[b, t]` is the token sampled *at* position t (callers shift by one
    beforehand). Returns `(logp_BxT, entropy_BxT)` in fp32 (fp64 for fp64 logits); both are
    differentiable.
    """
    if logits_BxTxV.ndim != 3 or targets_BxT.shape != logits_BxTxV.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and targets [B, T]; got {logits_BxTxV.shape} and "
            f"{targets_BxT.shape}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    def chunk(logits_BxCxV, targets_BxC):
        z = logits_BxCxV.astype(jnp.promote_types(logits_BxCxV.dtype, jnp.float32))
        if temperature != 1.0:
            z = z / temperature
        return _logp_and_entropy(z, targets_BxC)

    return _map_over_time(chunk, (logits_BxTxV, targets_BxT), chunk_size)


def logprobs_from_hidden(
    hidden_BxTxD: jax.Array,
    w_DxV: jax.Array,
    targets_BxT: jax.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Like `token_logprobs_and_entropy`, fusing the unembedding `hidden @ w` into each chunk.

    The `[B, T, V]` logits never exist: each chunk computes `[B, chunk_size, V]` logits with an
    fp32 accumulator and reduces them to log-prob and entropy (keeping the log-normaliser);
    the backward pass recomputes each chunk's logits and writes their gradient in closed form,

        d/dz_v = [v = y] g_logp - pi(v) (g_logp + g_H (log pi(v) + H)),

    in one pass over the chunk, in `w`'s dtype (bf16 products for bf16 weights, as torch's
    autograd runs them), then `d hidden = dz w^T` and `d w += hidden^T dz` (accumulated over
    chunks in fp32). This is the form to use for large V. Against autodiff of a checkpointed
    chunk (which wrote the gradient through a one-hot scatter, transposed, and ran its
    products in fp32): SmolLM2-135M's head (V = 49,152) over 1024 positions in bf16, forward
    and backward, 2.67 -> 1.3-1.5 s; its packed bf16 RL update (`bench real`'s batch) 22.3 ->
    17.7 s, fp32 25.2 -> 21.2 s (2-core AMD EPYC Zen 4, 2026-12-05).
    """
    if hidden_BxTxD.ndim != 3 or w_DxV.ndim != 2 or hidden_BxTxD.shape[2] != w_DxV.shape[0]:
        raise ValueError(
            f"expected hidden [B, T, D] and w [D, V] with matching D; got {hidden_BxTxD.shape} "
            f"and {w_DxV.shape}"
        )
    if targets_BxT.shape != hidden_BxTxD.shape[:2]:
        raise ValueError(f"targets {targets_BxT.shape} must be [B, T] = {hidden_BxTxD.shape[:2]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T = targets_BxT.shape
    if T == 0:
        empty = jnp.zeros((B, 0), jnp.promote_types(w_DxV.dtype, jnp.float32))
        return empty, empty
    with jax.named_scope("logprobs"):  # what `bench profile` attributes to the head and loss
        return _head(hidden_BxTxD, w_DxV, targets_BxT, min(chunk_size, T), float(temperature))


def _chunked(x: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """`x` [B, T, ...] as its full chunks [N, B, c, ...] and the leftover [B, T - N*c, ...]."""
    n = x.shape[1] // c
    full = jnp.moveaxis(x[:, : n * c].reshape(x.shape[0], n, c, *x.shape[2:]), 1, 0)
    return full, x[:, n * c :]


def _unchunked(full: jax.Array, tail: jax.Array) -> jax.Array:
    """Inverse of `_chunked`."""
    n, b, c = full.shape[:3]
    x = jnp.moveaxis(full, 0, 1).reshape(b, n * c, *full.shape[3:])
    return jnp.concatenate([x, tail], axis=1) if tail.shape[1] else x


def _head_logits(h_BxCxD, w_DxV, temperature):
    z = jnp.einsum(
        "bcd,dv->bcv", h_BxCxD, w_DxV,
        preferred_element_type=jnp.promote_types(w_DxV.dtype, jnp.float32),
    )
    return z / temperature if temperature != 1.0 else z


def _head_chunk(h_BxCxD, t_BxC, w_DxV, temperature):
    """(log pi(target), entropy, log-normaliser) of one chunk."""
    z = _head_logits(h_BxCxD, w_DxV, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    logq = z - lse[..., None]
    entropy = -jnp.sum(jnp.exp(logq) * logq, axis=-1)
    # Out-of-range ids (e.g. -1 used as padding) are clipped: such positions must be masked.
    idx = jnp.clip(t_BxC, 0, z.shape[-1] - 1)[..., None]
    return jnp.take_along_axis(logq, idx, axis=-1)[..., 0], entropy, lse


def _head_chunk_grads(h_BxCxD, t_BxC, lse, entropy, g_logp, g_ent, w_DxV, temperature):
    """(d hidden, d w in fp32) of one chunk, its logits recomputed."""
    z = _head_logits(h_BxCxD, w_DxV, temperature)
    logq = z - lse[..., None]
    idx = jnp.clip(t_BxC, 0, z.shape[-1] - 1)[..., None]
    onehot = lax.broadcasted_iota(jnp.int32, z.shape, 2) == idx
    g_logp, g_ent, entropy = g_logp[..., None], g_ent[..., None], entropy[..., None]
    dz = jnp.where(onehot, g_logp, 0.0) - jnp.exp(logq) * (g_logp + g_ent * (logq + entropy))
    if temperature != 1.0:
        dz = dz / temperature
    dz = dz.astype(w_DxV.dtype)
    acc = jnp.promote_types(w_DxV.dtype, jnp.float32)
    dh = jnp.einsum("bcv,dv->bcd", dz, w_DxV, preferred_element_type=acc).astype(h_BxCxD.dtype)
    dw = jnp.einsum("bcd,bcv->dv", h_BxCxD, dz, preferred_element_type=acc)
    return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head(h_BxTxD, w_DxV, t_BxT, c, temperature):
    return _head_fwd(h_BxTxD, w_DxV, t_BxT, c, temperature)[0]


def _head_fwd(h_BxTxD, w_DxV, t_BxT, c, temperature):
    (h_full, h_tail), (t_full, t_tail) = _chunked(h_BxTxD, c), _chunked(t_BxT, c)
    _, full = lax.scan(
        lambda _, x: (None, _head_chunk(*x, w_DxV, temperature)), None, (h_full, t_full))
    tail = _head_chunk(h_tail, t_tail, w_DxV, temperature)
    logp, ent, lse = (_unchunked(a, b) for a, b in zip(full, tail, strict=True))
    return (logp, ent), (h_BxTxD, w_DxV, t_BxT, lse, ent)


def _head_bwd(c, temperature, residuals, cotangents):
    h_BxTxD, w_DxV, t_BxT, lse, ent = residuals
    chunks = [_chunked(x, c) for x in (h_BxTxD, t_BxT, lse, ent, *cotangents)]

    def step(dw, x):
        dh, dw_chunk = _head_chunk_grads(*x, w_DxV, temperature)
        return dw + dw_chunk, dh

    acc = jnp.promote_types(w_DxV.dtype, jnp.float32)
    dw, dh_full = lax.scan(step, jnp.zeros(w_DxV.shape, acc), tuple(f for f, _ in chunks))
    dh_tail, dw_tail = _head_chunk_grads(*(t for _, t in chunks), w_DxV, temperature)
    return _unchunked(dh_full, dh_tail), (dw + dw_tail).astype(w_DxV.dtype), None


_head.defvjp(_head_fwd, _head_bwd)
