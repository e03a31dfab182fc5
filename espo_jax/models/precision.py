"""The parameters the forward reads only in its compute dtype (`ModelConfig.dtype`).

A learner keeps float32 master parameters and computes in `dtype` (bfloat16 at scale): each dense
and expert kernel is cast where a layer reads it, so the gradient of a float32 leaf is a
bfloat16 product converted to float32. Casting those leaves once, before the micro-batches,
gives the same forward bit for bit and the same products as gradients, without a float32 copy
of every gradient per micro-batch (the accumulator stays float32). What the forward reads in
float32 is left as given: the router's kernel (float32 logits) and the correction bias, norm
scales, the gated delta rule's decay parameters (A_log, dt_bias), and the embedding, whose
gradient is a scatter-add over every occurrence of a token (summed in bfloat16 it would
round).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from espo_jax.models.config import ModelConfig

# leaf names read through `jnp.asarray(w, dtype)` / `quant.maybe_dequant(w, dtype)` only
COMPUTE_LEAVES = ("kernel", "bias", "wi_gate", "wi_up", "wo", "conv_q", "conv_k", "conv_v")
FLOAT32_MODULES = ("router",)  # modules whose kernels the forward reads in float32


def _is_compute_leaf(path) -> bool:
    keys = [str(getattr(k, "key", k)) for k in path]
    return keys[-1] in COMPUTE_LEAVES and not any(k in FLOAT32_MODULES for k in keys)


def compute_params(config: ModelConfig, params: Any) -> Any:
    """`params` with the leaves the forward reads only at `config.dtype` cast to it (a no-op
    where `dtype` is the parameters' own)."""
    dtype = jnp.dtype(config.dtype)

    def cast(path, x):
        if (_is_compute_leaf(path) and jnp.issubdtype(x.dtype, jnp.floating)
                and jnp.finfo(x.dtype).bits > jnp.finfo(dtype).bits):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map_with_path(cast, params)
