"""Rotary position embedding: the frequencies (plain, or YaRN-scaled) and their application
(rotated halves, or interleaved pairs; all of a head's dims or its first `rotary_dim`).

The conventions are Hugging Face's (transformers `modeling_rope_utils` and the deepseek_v3 /
glm4_moe models):
- plain RoPE: inv_freq_i = theta^(-2i/R) over the R rotated dims; x's two halves are rotated
  together, x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
- YaRN (context extension by `rope_factor` from `rope_original_max_len`): each frequency is
  blended between the original (fast dims, extrapolated) and the original / factor (slow dims,
  interpolated) by a linear ramp over the dims whose rotation counts over the original context
  lie between `yarn_beta_fast` and `yarn_beta_slow`; cos and sin are scaled by an attention
  factor, 0.1 ln(factor) + 1 (or that of `yarn_mscale` over that of `yarn_mscale_all_dim`).
  DeepSeek's MLA further scales its softmax by mscale(factor, mscale_all_dim)^2
  (`softmax_scale_factor`). Positions past the original context need nothing more: the
  frequencies are fixed.
- interleaved (DeepSeek): dims (2i, 2i+1) are rotated as a pair by frequency i, and the result is
  laid out [rotated evens, rotated odds], as transformers does it. Queries and keys share the
  layout, so their dot products are those of the interleaved rotation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from espo_jax.models.config import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def frequencies(config: ModelConfig, dim: int) -> tuple[jax.Array, float]:
    """(inv_freq [dim / 2] fp32, the factor cos and sin are scaled by) for `dim` rotated dims."""
    c = config
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    if c.rope_scaling == "default":
        return 1.0 / (c.rope_theta ** exponents), 1.0
    pos_freqs = c.rope_theta ** exponents
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (c.rope_factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(c.rope_original_max_len / (rotations * 2 * math.pi))
                / (2 * math.log(c.rope_theta)))

    low, high = correction_dim(c.yarn_beta_fast), correction_dim(c.yarn_beta_slow)
    if c.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    if c.yarn_attention_factor:
        factor = c.yarn_attention_factor
    elif c.yarn_mscale and c.yarn_mscale_all_dim:
        factor = (yarn_mscale(c.rope_factor, c.yarn_mscale)
                  / yarn_mscale(c.rope_factor, c.yarn_mscale_all_dim))
    else:
        factor = yarn_mscale(c.rope_factor)
    return inv_freq, float(factor)


def softmax_scale_factor(config: ModelConfig) -> float:
    """The factor on MLA's 1/sqrt(head dim) softmax scale: mscale(factor, mscale_all_dim)^2
    under YaRN with `yarn_mscale_all_dim` set (DeepSeek-V3), else 1."""
    c = config
    if c.rope_scaling == "default" or not c.yarn_mscale_all_dim:
        return 1.0
    return yarn_mscale(c.rope_factor, c.yarn_mscale_all_dim) ** 2


def apply_rotary(x_BxTxNxR: jax.Array, positions_BxT: jax.Array, inv_freq: jax.Array,
                 scale: float = 1.0, interleave: bool = False) -> jax.Array:
    """x rotated by position * inv_freq, cos and sin times `scale` (see the module docstring for
    the two layouts)."""
    freqs_BxTxR2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    # cos and sin once per token, materialised: fused into their consumers XLA evaluates them
    # again for every head of q and k, forward and backward (bench peers' train step: 12% of
    # its attention time).
    cos, sin = jax.lax.optimization_barrier((jnp.cos(freqs_BxTxR2), jnp.sin(freqs_BxTxR2)))
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    if interleave:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        x1, x2 = x_BxTxNxR[..., 0::2], x_BxTxNxR[..., 1::2]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x_BxTxNxR.dtype)
    cos = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]
    sin = jnp.concatenate([sin, sin], axis=-1)[:, :, None, :]
    x1, x2 = jnp.split(x_BxTxNxR, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x_BxTxNxR * cos + rotated * sin).astype(x_BxTxNxR.dtype)


def rope(x_BxTxNxA: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """Plain RoPE over all of x's head dims (halves rotated, not interleaved)."""
    a = x_BxTxNxA.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, a, 2, dtype=jnp.float32) / a))
    return apply_rotary(x_BxTxNxA, positions_BxT, inv_freq)


def rotate(config: ModelConfig, x_BxTxNxA: jax.Array, positions_BxT: jax.Array,
           dim: int | None = None) -> jax.Array:
    """`config`'s RoPE on the first `dim` dims of each head (all by default); the rest pass."""
    a = x_BxTxNxA.shape[-1]
    dim = a if dim is None else dim
    inv_freq, scale = frequencies(config, dim)
    if dim == a:
        return apply_rotary(x_BxTxNxA, positions_BxT, inv_freq, scale, config.rope_interleave)
    rotated = apply_rotary(x_BxTxNxA[..., :dim], positions_BxT, inv_freq, scale,
                           config.rope_interleave)
    return jnp.concatenate([rotated, x_BxTxNxA[..., dim:]], axis=-1)
