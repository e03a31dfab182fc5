"""Per-token log-probabilities of sampled tokens and full-vocabulary entropies, chunked.

An RL learner needs, at every position of every response, `log pi(y_t | y_<t)` of the sampled
token and the entropy `H_t = -sum_v pi(v) log pi(v)` of the whole next-token distribution (ESPO
groups and clips by it, RL-ZVP shapes advantages with it). With Qwen3's V = 151,936 an fp32
`[B, T, V]` tensor is 600 KB per token, so both functions here walk the sequence in chunks of
`chunk_size` positions with `lax.scan`, and wrap the per-chunk computation in `jax.checkpoint`
so the backward pass recomputes each chunk's softmax instead of storing it: temporaries are
`O(B * chunk_size * V)` whatever T is. The leftover positions (T not a multiple of the chunk)
form one smaller chunk; nothing is padded or copied.

Shapes: B batch, T positions, V vocabulary, D model width.
"""

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
    fp32 accumulator, reduces them to log-prob and entropy, and the backward pass recomputes them
    chunk by chunk (gradients flow to `hidden` and `w`). This is the form to use for large V.
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

    def chunk(hidden_BxCxD, targets_BxC):
        z = jnp.einsum(
            "bcd,dv->bcv",
            hidden_BxCxD,
            w_DxV,
            preferred_element_type=jnp.promote_types(w_DxV.dtype, jnp.float32),
        )
        if temperature != 1.0:
            z = z / temperature
        return _logp_and_entropy(z, targets_BxC)

    return _map_over_time(chunk, (hidden_BxTxD, targets_BxT), chunk_size)
