"""FP8 (float8_e4m3fn) weight quantisation with per-output-channel or 128x128 block scales.

A quantised kernel is the pytree `{"qvalue": float8_e4m3fn [..., in, out], "scale": float32}`
with `kernel ~= qvalue * scale`. The scale's shape says which scheme: `[..., 1, out]` per
output channel (`[V, 1]`, per row, for an embedding), or `[..., ceil(in/128), ceil(out/128)]`
per 128x128 block (DeepSeek-V3's checkpoint format: blocks start at index 0, edge blocks are
partial, leading axes such as the expert axis each get their own). The model reads every
kernel through `maybe_dequant`, so a quantised parameter tree runs through the same `forward`
as a float one (dequantised on the fly, the matmul itself in the compute dtype). This is what
the rollout engine runs (FP8 rollouts); the learner keeps float parameters.

Which kernels are quantised is chosen per parameter group (GROUPS); the router and the LM head
stay in high precision by default, as in vLLM's FP8 MoE checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
BLOCK = 128  # block scales: one per BLOCK x BLOCK tile of the last two axes
SCHEMES = ("channel", "block")
GROUPS = ("attn", "experts", "mlp", "shared_expert", "router", "lm_head", "embed")
DEFAULT_GROUPS = ("attn", "experts", "mlp", "shared_expert")


def is_quantized(w: Any) -> bool:
    return isinstance(w, Mapping) and "qvalue" in w  # dict, or FrozenDict inside Linen


def maybe_dequant(w: Any, dtype: Any = jnp.float32) -> jax.Array:
    """The kernel `w` as a `dtype` array, dequantising an FP8 `{"qvalue", "scale"}` pytree:
    every E4M3 value times its channel's or its block's float32 scale."""
    if is_quantized(w):
        q = w["qvalue"]
        return (q.astype(jnp.float32) * expand_scale(w["scale"], q.shape)).astype(dtype)
    return jnp.asarray(w).astype(dtype)


def expand_scale(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`scale` made to broadcast against a kernel of `shape`: a per-channel scale as is; a block
    axis (ceil(n/BLOCK) entries for n > 1) repeated BLOCK times and cut to n. (A block axis of
    one entry broadcasts as it is: one block covers the whole axis.)"""
    for axis in (-2, -1):
        n, s = shape[axis], scale.shape[axis]
        if s in (1, n):
            continue
        if s != -(-n // BLOCK):
            raise ValueError(f"scale shape {scale.shape} fits neither channel nor {BLOCK}x{BLOCK} "
                             f"block scales of a kernel of shape {tuple(shape)}")
        scale = jax.lax.slice_in_dim(jnp.repeat(scale, BLOCK, axis=axis), 0, n, axis=axis)
    return scale


def quantize_kernel(w_IxO: jax.Array) -> dict[str, jax.Array]:
    """E4M3 values and float32 scales per output channel (last axis; leading axes, e.g. the
    expert axis, each get their own scales). scale = amax / 448 maps a channel's largest
    magnitude onto the largest finite E4M3 value; all-zero channels get scale 1."""
    w = jnp.asarray(w_IxO, jnp.float32)
    if w.ndim < 2:
        raise ValueError(f"quantize_kernel expects a [..., in, out] kernel, got shape {w.shape}")
    amax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return {"qvalue": q, "scale": scale}


def quantize_kernel_blocks(w_IxO: jax.Array) -> dict[str, jax.Array]:
    """E4M3 values and float32 scales per BLOCK x BLOCK tile of the last two axes (as
    DeepSeek-V3's checkpoints: scale = amax(tile) / 448; edge tiles partial; all-zero tiles
    get scale 1). An outlier then coarsens only its own tile, not its whole channel."""
    w = jnp.asarray(w_IxO, jnp.float32)
    if w.ndim < 2:
        raise ValueError(f"quantize_kernel_blocks expects a [..., in, out] kernel, got shape "
                         f"{w.shape}")
    (r, c), lead = w.shape[-2:], w.shape[:-2]
    nr, nc = -(-r // BLOCK), -(-c // BLOCK)
    padded = jnp.pad(jnp.abs(w), [(0, 0)] * len(lead) + [(0, nr * BLOCK - r), (0, nc * BLOCK - c)])
    amax = jnp.max(padded.reshape(*lead, nr, BLOCK, nc, BLOCK), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = jnp.clip(w / expand_scale(scale, w.shape), -FP8_MAX, FP8_MAX).astype(FP8)
    return {"qvalue": q, "scale": scale}


def _group_of(path: tuple[str, ...]) -> str | None:
    """The quantisation group of the kernel at `path` in the parameter tree (None: never)."""
    if path[0] == "embed":
        return "embed"
    if path[0] == "lm_head":
        return "lm_head"
    if len(path) < 2 or not path[0].startswith("layers_"):
        return None
    if path[-1] not in ("kernel", "wi_gate", "wi_up", "wo", "embedding"):
        return None  # norms, biases
    part = path[1]
    if part == "attn":
        return "attn"
    if part == "mlp":
        return "mlp"
    if part == "moe":
        if path[2] == "router":
            return "router"
        if path[2] in ("shared_expert", "shared_expert_gate"):
            return "shared_expert"
        return "experts"
    return None


def quantize_params(
    params: dict, config: Any = None, groups: Iterable[str] = DEFAULT_GROUPS,
    scheme: str = "channel",
) -> dict:
    """A copy of `params` whose kernels in `groups` are FP8 `{"qvalue", "scale"}` pytrees, with
    per-output-channel scales (`scheme="channel"`) or BLOCK x BLOCK block scales ("block").

    `config` is accepted for symmetry with the other entry points and checked against the tree
    (tied embeddings cannot quantise "lm_head" separately from "embed")."""
    groups = tuple(groups)
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise ValueError(f"unknown quantisation groups {bad}; valid groups: {GROUPS}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantisation scheme {scheme!r}; valid schemes: {SCHEMES}")
    if config is not None and config.tie_embeddings and "lm_head" in groups:
        raise ValueError("tie_embeddings: the LM head is the embedding; quantise group 'embed'")

    def visit(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for name, value in tree.items():
            p = path + (name,)
            if isinstance(value, dict) and not is_quantized(value):
                out[name] = visit(value, p)
            elif _group_of(p) in groups and not is_quantized(value):
                if scheme == "block":  # tiles are the same whichever axis is "out"
                    out[name] = quantize_kernel_blocks(value)
                elif name == "embedding":  # [V, D]: a row per token; scale per row (transpose).
                    q = quantize_kernel(jnp.asarray(value).T)
                    out[name] = {"qvalue": q["qvalue"].T, "scale": q["scale"].T}
                else:
                    out[name] = quantize_kernel(value)
            else:
                out[name] = value
        return out

    return visit(params, ())


def dequantize_params(qparams: dict, dtype: Any = jnp.float32) -> dict:
    """Float parameters from a (partly) quantised tree."""
    if is_quantized(qparams):
        return maybe_dequant(qparams, dtype)
    if isinstance(qparams, dict):
        return {k: dequantize_params(v, dtype) for k, v in qparams.items()}
    return qparams


def param_bytes(params: dict) -> int:
    """Bytes of all leaves (FP8 values count one byte each)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
