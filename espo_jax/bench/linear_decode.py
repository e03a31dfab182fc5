"""Decode cost of a linear (Gated DeltaNet) layer against a full-attention layer.

`python -m espo_jax.bench linear_decode [--quick] [--out FILE.json]`

The one-token decode step of one token mixer, jitted, for a batch of `SLOTS` sequences: the
Gated DeltaNet's recurrent form (`gated_deltanet.recurrent_step`: its conv windows and its
[Hv, Dk, Dv] float32 state, read and written back) against the cached GQA attention
(`gqa.Attention` with a bf16 KV cache of 1k and 8k tokens, the new token's key and value
written in). Each at the `qwen35_35b_a3b` preset's dims (d 2048; full layers 16 / 2 heads of
256 with the output gate; linear layers 16 key heads x 128, 32 value heads x 128, conv 4; bf16
weights), projections included, the MoE block not (it is the same for both). With `--quick`,
the `tiny_qwen35_moe` preset's dims and contexts of 64 and 512 tokens (what CI runs).

Per step and per token (a step decodes one token of each slot): median seconds (the two
layers timed alternately so machine load hits both alike; the caches are donated, as a decode
loop's are, so the step writes them in place), and the bytes of cache a token's step reads:
the linear layer's conv windows and state whatever the context, the full layer's keys and
values of every cached token. The figures also hold the CPU count and the 1-minute load
average before and after.
"""

from __future__ import annotations

import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp

from espo_jax.bench import format_table
from espo_jax.bench.model import decode_step_medians
from espo_jax.models import get_preset
from espo_jax.models.config import ModelConfig
from espo_jax.models.gated_deltanet import GatedDeltaNet, cache_shapes
from espo_jax.models.gqa import Attention

SLOTS = 4


def cache_bytes_per_token(config: ModelConfig, kind: str, context: int) -> int:
    """Bytes of one layer's cache that one sequence's decode step reads (bf16 windows and keys
    and values, the float32 state)."""
    if kind == "linear":
        return sum(math.prod(shape[1:]) * jnp.dtype(dt or config.dtype).itemsize
                   for shape, dt in cache_shapes(config, 1).values())
    return context * 2 * config.n_kv_heads * config.head_dim * jnp.dtype(config.dtype).itemsize


def _layer(config: ModelConfig, kind: str, context: int):
    """(jitted step(params, x, cache) -> (y, cache), params, cache) of one mixer; the cache's
    first context - 1 slots hold tokens (random), the step's token is at context - 1."""
    b = SLOTS
    module = GatedDeltaNet(config) if kind == "linear" else Attention(config)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (b, 1, config.d_model), config.dtype)
    positions = jnp.full((b, 1), context - 1, jnp.int32)
    segments = jnp.ones((b, 1), jnp.int32)
    if kind == "linear":
        cache = {name: jax.random.normal(keys[1], shape, dt or config.dtype) * 0.1
                 for name, (shape, dt) in cache_shapes(config, b).items()}
        mask = None
    else:
        kv, a = config.n_kv_heads, config.head_dim
        cache = {"k": jax.random.normal(keys[1], (b, kv, a, context), config.dtype),
                 "v": jax.random.normal(keys[2], (b, kv, context, a), config.dtype)}
        mask = jnp.broadcast_to(jnp.arange(context) < context - 1, (b, context))
    params = nn.meta.unbox(module.init(keys[3], x, positions, segments, cache, mask)["params"])

    def step(params, x, cache):
        return module.apply({"params": params}, x, positions, segments, cache, mask)

    return jax.jit(step, donate_argnums=2), params, x, cache


def measure(config: ModelConfig, contexts: tuple[int, ...], repeats: int) -> list[dict]:
    rows = []
    for context in contexts:
        seconds = decode_step_medians(
            {kind: _layer(config, kind, context) for kind in ("linear", "full")}, repeats)
        row = {"context": context, "slots": SLOTS}
        for kind in ("linear", "full"):
            row[f"{kind}_step_s"] = seconds[kind]
            row[f"{kind}_s_per_token"] = seconds[kind] / SLOTS
            row[f"{kind}_cache_bytes_per_token"] = cache_bytes_per_token(config, kind, context)
        row["full_over_linear_time"] = seconds["full"] / seconds["linear"]
        rows.append(row)
    return rows


def run(quick: bool) -> dict:
    preset = "tiny_qwen35_moe" if quick else "qwen35_35b_a3b"
    config = get_preset(preset)
    contexts = (64, 512) if quick else (1024, 8192)
    load = os.getloadavg()[0]
    rows = measure(config, contexts, repeats=5 if quick else 21)
    print(f"one `{preset}` token mixer, one-token decode step, {SLOTS} slots (jitted, "
          "medians):")
    print(format_table(
        ["context", "linear ms/token", "full ms/token", "full / linear",
         "linear cache KiB/token", "full cache KiB/token"],
        [[r["context"], r["linear_s_per_token"] * 1e3, r["full_s_per_token"] * 1e3,
          r["full_over_linear_time"], r["linear_cache_bytes_per_token"] / 1024,
          r["full_cache_bytes_per_token"] / 1024] for r in rows]))
    # the machine's 1-minute load average before and after (a shared CPU's timings vary)
    return {"preset": preset, "dtype": config.dtype, "cpus": os.cpu_count(),
            "load_avg_1m": [load, os.getloadavg()[0]], "rows": rows}
