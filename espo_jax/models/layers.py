"""Building blocks of the decoder: RMSNorm, dense projections and the SwiGLU MLP. The token
mixers have their own files: grouped-query attention `gqa.Attention`, DeepSeek's latent
attention `mla.LatentAttention`, Gated DeltaNet `gated_deltanet.GatedDeltaNet`; the attention
math they share (masks, softmax, chunks, the KV cache's writes) is `attention`.

Every weight is declared with logical axis names (`nn.with_logical_partitioning`), which
espo_jax/sharding.py maps to mesh axes. Kernels are read through `weight`, which returns a
caller-supplied value as is (a float array or an FP8 pytree from `quant.quantize_params`), so
one forward serves float and quantised parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from espo_jax.models import quant
from espo_jax.models.config import ModelConfig

Axes = tuple[str | None, ...]


def weight(
    module: nn.Module, name: str, init: Callable, shape: tuple[int, ...], axes: Axes, dtype: Any
) -> Any:
    """The parameter `name` of `module`: declared (with logical axes) at init, read as given at
    apply time (possibly an FP8 `{"qvalue", "scale"}` pytree, which `nn.Module.param` would
    reject because its shape differs from the float initialiser's)."""
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * scale, the statistics in fp32 (HF Qwen3RMSNorm). With
    `zero_centered` (Qwen3-Next, Qwen3.5) the factor is (1 + scale), scale initialised to 0,
    applied in fp32 before the cast (HF Qwen3NextRMSNorm)."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    zero_centered: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
        scale = weight(self, "scale", init, (x.shape[-1],), ("norm",), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.zero_centered:
            return (y * (1.0 + jnp.asarray(scale, jnp.float32))).astype(self.dtype)
        return jnp.asarray(scale, self.dtype) * y.astype(self.dtype)


def matmul(x: jax.Array, w: jax.Array, dtype: Any) -> jax.Array:
    """`x @ w` in `dtype`, accumulated in fp32. Below fp32 the product is asked for in fp32
    and rounded after: XLA:CPU's fast bf16 kernels (YNNPACK's, on CPUs with AVX512-BF16 or
    AMX) produce fp32 only, and a bf16 x bf16 -> bf16 dot there falls back to a slow path
    (64 x 576 x 1536: 37 GFLOP/s, against 164 for -> fp32 and 81 in fp32; 2-core AMD EPYC
    Zen 4, 2026-12-05). GPUs and TPUs accumulate bf16 products in fp32 either way. The
    gradient products stay autodiff's (the fp32 cotangent times the bf16 operand, an fp32
    product): YNNPACK takes only untransposed operands, and bf16 products with a transposed
    one measured slower than fp32 (71-81 against 92-101 GFLOP/s, 2048 x 576 x 1536)."""
    if jnp.dtype(dtype).itemsize >= 4:
        return jnp.dot(x, w)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)


class Dense(nn.Module):
    """y = x @ kernel (+ bias); kernel stored [in, out] with logical `axes`."""

    features: int
    axes: Axes
    use_bias: bool = False
    std: float = 0.02
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    out_dtype: Any = None  # the product's dtype, unrounded (None: `dtype`)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = weight(self, "kernel", nn.initializers.normal(self.std),
                        (x.shape[-1], self.features), self.axes, self.param_dtype)
        # One [tokens, in] x [in, out] product: with the token axes kept apart ([B, T, in]),
        # XLA:CPU takes the kernel's gradient from a transposed copy of the output gradient,
        # fused into the elementwise ops before it (a SwiGLU MLP's gradient at [64, 64, 128]:
        # 61 ms that way, 28 ms this way).
        x2 = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        w = quant.maybe_dequant(kernel, self.dtype)
        y = (matmul(x2, w, self.dtype) if self.out_dtype is None else
             jnp.dot(x2, w, preferred_element_type=self.out_dtype))
        y = y.reshape(*x.shape[:-1], -1)
        if self.use_bias:
            bias = weight(self, "bias", nn.initializers.zeros, (self.features,),
                          (self.axes[-1],), self.param_dtype)
            y = y + jnp.asarray(bias, self.dtype)
        return y


def dense(config: ModelConfig, features: int, axes: Axes, name: str, bias: bool = False) -> Dense:
    return Dense(features, axes, use_bias=bias, std=config.init_std, dtype=config.dtype,
                 param_dtype=config.param_dtype, name=name)


def rms_norm(config: ModelConfig, name: str) -> RMSNorm:
    return RMSNorm(config.rms_eps, dtype=config.dtype, param_dtype=config.param_dtype,
                   zero_centered=config.norm_zero_centered, name=name)


class Mlp(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (dense layers and the shared expert)."""

    config: ModelConfig
    d_ff: int

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        c = self.config
        gate = dense(c, self.d_ff, ("embed", "mlp"), "gate_proj")(x_BxTxD)
        up = dense(c, self.d_ff, ("embed", "mlp"), "up_proj")(x_BxTxD)
        return dense(c, c.d_model, ("mlp", "embed"), "down_proj")(nn.silu(gate) * up)
