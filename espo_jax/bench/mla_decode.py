"""Decode cost of DeepSeek-V3's latent attention (MLA): kv_b_proj absorbed against expanded.

`python -m espo_jax.bench mla_decode [--quick] [--out FILE.json]`

The one-token decode step of one `mla.LatentAttention` layer, jitted, for `SLOTS` sequences
over a cache of `context` slots (each token's latent and rope key, in `kv_cache_dtype`: fp32 on
a CPU), the step's token written in: absorbed (what the engine runs: each head's query taken
into the latent space, `espo_jax.models.mla`) against expanded (`absorb=False`: every cached
latent through kv_b_proj at every step, as transformers does). At the `deepseek_v3` preset's
dims with `HEADS` heads instead of 128 (d 7168, q_lora 1536, kv_lora C 512, rope R 64, nope P
128, value Dv 128; bf16 weights), projections included; with `--quick`, the
`tiny_deepseek_v3` preset and contexts of 64 and 512 tokens (what CI runs).

Per context: the median seconds of a step (the two timed alternately, so machine load hits both
alike; the caches donated, as a decode loop's are), their ratio, the multiply-adds per slot of
the step's attention part each way (absorbed H * (C * (P + Dv) + S * (2C + R)); expanded
S * C * H * (P + Dv) + H * S * (P + R + Dv)), and the largest difference between the two
outputs relative to the largest output (they compute the same function in another order).
The figures also hold the CPU count and the 1-minute load average before and after.
"""

from __future__ import annotations

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from espo_jax.bench import format_table
from espo_jax.bench.model import decode_step_medians
from espo_jax.models import get_preset
from espo_jax.models.config import ModelConfig
from espo_jax.models.mla import LatentAttention, latent_cache_shapes
from espo_jax.models.transformer import kv_cache_dtype

SLOTS = 4
HEADS = 16
KINDS = ("absorbed", "expanded")


def attention_macs(config: ModelConfig, kind: str, context: int) -> int:
    """Multiply-adds per slot of a decode step's attention over `context` cached tokens, less
    the projections both ways share (q, kv_a, o)."""
    h, c, r = config.n_heads, config.kv_lora_rank, config.qk_rope_head_dim
    p, dv = config.qk_nope_head_dim, config.v_head_dim
    if kind == "absorbed":
        return h * (c * (p + dv) + context * (2 * c + r))
    return context * c * h * (p + dv) + h * context * (p + r + dv)


def _layer(config: ModelConfig, kind: str, context: int):
    """(step(params, x, cache) -> (y, cache), its undonated twin, params, x, cache) of one
    layer; the cache's first context - 1 slots hold tokens (random), the step's token goes at
    context - 1."""
    module = LatentAttention(config, absorb=kind == "absorbed")
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (SLOTS, 1, config.d_model), config.dtype)
    positions = jnp.full((SLOTS, 1), context - 1, jnp.int32)
    segments = jnp.ones((SLOTS, 1), jnp.int32)
    dtype = kv_cache_dtype(config)
    cache = {name: jax.random.normal(k, shape, dtype)
             for k, (name, shape) in zip(keys[1:3], latent_cache_shapes(
                 config, SLOTS, context).items(), strict=True)}
    mask = jnp.broadcast_to(jnp.arange(context) < context - 1, (SLOTS, context))
    params = nn.meta.unbox(module.init(keys[3], x, positions, segments, cache, mask)["params"])

    def step(params, x, cache):
        return module.apply({"params": params}, x, positions, segments, cache, mask)

    return jax.jit(step, donate_argnums=2), jax.jit(step), params, x, cache


def measure(config: ModelConfig, contexts: tuple[int, ...], repeats: int) -> list[dict]:
    rows = []
    for context in contexts:
        steps, outputs = {}, {}
        for kind in KINDS:
            step, plain, params, x, cache = _layer(config, kind, context)
            outputs[kind] = np.asarray(plain(params, x, cache)[0], np.float32)
            steps[kind] = step, params, x, cache
        seconds = decode_step_medians(steps, repeats)
        row = {"context": context, "slots": SLOTS}
        for kind in KINDS:
            row[f"{kind}_step_s"] = seconds[kind]
            row[f"{kind}_attention_macs_per_slot"] = attention_macs(config, kind, context)
        row["expanded_over_absorbed_time"] = seconds["expanded"] / seconds["absorbed"]
        row["output_rel_diff"] = float(np.abs(outputs["absorbed"] - outputs["expanded"]).max()
                                       / np.abs(outputs["expanded"]).max())
        rows.append(row)
    return rows


def run(quick: bool) -> dict:
    preset = "tiny_deepseek_v3" if quick else "deepseek_v3"
    config = get_preset(preset)
    if not quick:  # DeepSeek-V3's dims, fewer heads: the expanded side's step stays under 1 s
        config = dataclasses.replace(config, n_heads=HEADS, n_kv_heads=HEADS)
    contexts = (64, 512) if quick else (1024, 4096)
    load = os.getloadavg()[0]
    rows = measure(config, contexts, repeats=5 if quick else 11)
    print(f"one `{preset}` MLA layer ({config.n_heads} heads, {config.dtype}), one-token decode "
          f"step, {SLOTS} slots (jitted, medians):")
    print(format_table(
        ["context", "absorbed ms", "expanded ms", "expanded / absorbed", "attention MMAC/slot "
         "absorbed", "expanded", "output rel. diff"],
        [[r["context"], r["absorbed_step_s"] * 1e3, r["expanded_step_s"] * 1e3,
          r["expanded_over_absorbed_time"], r["absorbed_attention_macs_per_slot"] / 1e6,
          r["expanded_attention_macs_per_slot"] / 1e6, r["output_rel_diff"]] for r in rows]))
    # the machine's 1-minute load average before and after (a shared CPU's timings vary)
    return {"preset": preset, "heads": config.n_heads, "dtype": config.dtype,
            "cache_dtype": jnp.dtype(kv_cache_dtype(config)).name, "cpus": os.cpu_count(),
            "load_avg_1m": [load, os.getloadavg()[0]], "rows": rows}
