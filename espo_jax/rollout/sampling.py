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


def sample(
    logits_BxV: jax.Array,
    keys_B: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-prob (see module doc); row b uses only `keys_B[b]`.
    Its ops carry the name scope `sampling` (for profiles; `bench profile`)."""
    with jax.named_scope("sampling"):
        x_BxV = truncated_logits(logits_BxV, temperature_B, top_k_B, top_p_B)
        sampled_B = jax.vmap(jax.random.categorical)(keys_B, x_BxV)
        greedy_B = temperature_B <= 0
        tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BxV, axis=-1),
                             sampled_B).astype(jnp.int32)
        logp_BxV = jnp.where(
            greedy_B[:, None],
            jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1),
            jax.nn.log_softmax(x_BxV, axis=-1),
        )
        return tokens_B, jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
