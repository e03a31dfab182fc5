"""Token sampling for the rollout engine: temperature, top-k, top-p, and the sampled log-prob.

The recorded log-prob of a sampled token is its log-probability under the distribution it was
actually drawn from: logits / temperature, restricted to the top-k tokens and then to the
top-p nucleus, renormalised. With temperature 1, top_k 0 and top_p 1 that is exactly the
model's log-softmax, which is what the learner recomputes, so the importance ratio starts at 1
up to numerics. With truncation the behaviour policy *is* the truncated distribution, and the
recorded value says so (the learner's ratio then measures the truncation as off-policyness).
Greedy decoding (temperature 0) records the model's untempered log-softmax of the argmax token
(the log-prob of a point mass, 0, would carry no information).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn and when a response ends.

    The engine keeps these per decode slot as arrays, so changing them never recompiles.
    """

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0  # 1 = no nucleus truncation
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


def truncated_logits(
    logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array
) -> jax.Array:
    """fp32 logits / temperature with tokens outside top-k, then top-p, set to -inf.

    Per-row parameters (traced, so one compiled step serves every setting): top_k 0 and
    top_p >= 1 keep everything; a row with temperature 0 is divided by 1 (greedy rows use the
    raw logits; see `sample`). Ties at the k-th value are kept. When no row truncates (the RL
    default: temperature 1, top_k 0, top_p 1) the vocabulary sort is skipped (`lax.cond`).
    """
    x = logits_BxV.astype(jnp.float32)
    x = x / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    truncating = jnp.any((top_k_B > 0) | (top_p_B < 1.0))
    return jax.lax.cond(truncating, _truncate, lambda x, *_: x, x, top_k_B, top_p_B)


def _truncate(x: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    v = x.shape[-1]
    sorted_BxV = jnp.sort(x, axis=-1)[:, ::-1]
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, jnp.clip(top_k_B - 1, 0, v - 1)[:, None], axis=-1)
    kth_Bx1 = jnp.where(top_k_B[:, None] > 0, kth_Bx1, -jnp.inf)
    sorted_BxV = jnp.where(sorted_BxV < kth_Bx1, -jnp.inf, sorted_BxV)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    # The smallest prefix whose mass reaches top_p (the first token always); top_p >= 1 keeps
    # all (a cumulative fp32 sum can reach 1.0 before the tail, which must not be cut).
    keep_BxV = (mass_before_BxV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)
    cutoff_Bx1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < jnp.maximum(cutoff_Bx1, kth_Bx1), -jnp.inf, x)


BLOCK = 256  # tokens per block of the two-level inverse-CDF draw (`categorical`)


def categorical(x_BxV: jax.Array, u_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row drawn from softmax(x) by inverse CDF with one uniform `u_B` in [0, 1)
    per row, and each row's logsumexp(x).

    The token is the first whose cumulative probability exceeds u * total, found in two levels:
    the block of BLOCK tokens (cumulative sums over the blocks' sums), then the token inside
    it. So the [B, V] work is one exp and one sum, against a Gumbel draw of B x V uniforms
    (`jax.random.categorical`), which took ~60% of a SmolLM2 decode step on a 2-core CPU
    (64 x 49152 logits: 200 ms against ~10). Tokens of zero probability (-inf) are never drawn:
    where rounding puts u * total past a block's last token, the draw stays on the last
    token of nonzero probability.
    """
    b, v = x_BxV.shape
    n_blocks = -(-v // BLOCK)
    m_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
    p_BxV = jnp.exp(x_BxV - m_Bx1)
    p_BxNxK = jnp.pad(p_BxV, ((0, 0), (0, n_blocks * BLOCK - v))).reshape(b, n_blocks, BLOCK)
    block_BxN = jnp.sum(p_BxNxK, axis=-1)
    cum_BxN = jnp.cumsum(block_BxN, axis=-1)
    total_B = cum_BxN[:, -1]
    target_B = u_B * total_B

    def first_past(cum_BxK, mass_BxK, t_B):  # first entry whose cumulative sum passes t
        k = cum_BxK.shape[-1]
        i_B = jnp.sum(cum_BxK <= t_B[:, None], axis=-1)
        last_B = k - 1 - jnp.argmax(mass_BxK[:, ::-1] > 0, axis=-1)
        return jnp.minimum(i_B, last_B)

    blk_B = first_past(cum_BxN, block_BxN, target_B)
    before_B = (jnp.take_along_axis(cum_BxN, blk_B[:, None], axis=-1)
                - jnp.take_along_axis(block_BxN, blk_B[:, None], axis=-1))[:, 0]
    inner_BxK = jnp.take_along_axis(p_BxNxK, blk_B[:, None, None], axis=1)[:, 0]
    idx_B = first_past(jnp.cumsum(inner_BxK, axis=-1), inner_BxK, target_B - before_B)
    return (blk_B * BLOCK + idx_B).astype(jnp.int32), m_Bx1[:, 0] + jnp.log(total_B)


BLOCKWISE_MIN_VOCAB = 4096  # vocabularies at least this large draw with `categorical`


def sample(
    logits_BxV: jax.Array,
    keys_B: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-prob (see module doc); row b uses only `keys_B[b]`.
    Its ops carry the name scope `sampling` (for profiles; `bench profile`).

    Two exact samplers of the same distribution, chosen by the vocabulary size (static, so one
    per compiled program): below `BLOCKWISE_MIN_VOCAB` tokens a Gumbel draw
    (`jax.random.categorical`) and log-softmax, as every stored result of the tiny models was
    sampled; from it, the two-level inverse-CDF draw (`categorical`) with log-probs as logit -
    logsumexp, which is what a real vocabulary needs (SmolLM2's 49152 tokens, 64 rows, 2-core
    CPU: sampling 190 -> 7 thread-ms of a 713 ms decode step). Either way a key gives one
    token; the two map keys to tokens differently."""
    with jax.named_scope("sampling"):
        x_BxV = truncated_logits(logits_BxV, temperature_B, top_k_B, top_p_B)
        if logits_BxV.shape[-1] < BLOCKWISE_MIN_VOCAB:
            return _sample_gumbel(logits_BxV, x_BxV, keys_B, temperature_B)
        return _sample_blockwise(logits_BxV, x_BxV, keys_B, temperature_B)


def _sample_gumbel(logits_BxV, x_BxV, keys_B, temperature_B):
    sampled_B = jax.vmap(jax.random.categorical)(keys_B, x_BxV)
    greedy_B = temperature_B <= 0
    tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BxV, axis=-1), sampled_B).astype(jnp.int32)
    logp_BxV = jnp.where(
        greedy_B[:, None],
        jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1),
        jax.nn.log_softmax(x_BxV, axis=-1),
    )
    return tokens_B, jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]


def _sample_blockwise(logits_BxV, x_BxV, keys_B, temperature_B):
    u_B = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)
    sampled_B, lse_B = categorical(x_BxV, u_B)
    greedy_B = temperature_B <= 0
    raw_BxV = logits_BxV.astype(jnp.float32)
    # a greedy row takes the argmax, its log-prob of the untempered logits: both computed only
    # when a row is greedy (the RL default has none)
    argmax_B, raw_lse_B = jax.lax.cond(
        jnp.any(greedy_B),
        lambda r: (jnp.argmax(r, axis=-1).astype(jnp.int32), jax.nn.logsumexp(r, axis=-1)),
        lambda r: (jnp.zeros(r.shape[:1], jnp.int32), jnp.zeros(r.shape[:1], r.dtype)),
        raw_BxV)
    tokens_B = jnp.where(greedy_B, argmax_B, sampled_B)
    # log-prob = logit - logsumexp, gathered (no [B, V] log-softmax)
    at = lambda a_BxV: jnp.take_along_axis(a_BxV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, jnp.where(greedy_B, at(raw_BxV) - raw_lse_B, at(x_BxV) - lse_B)
