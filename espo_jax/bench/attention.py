"""Attention benchmark: unchunked vs chunked attention (`ModelConfig.attention_chunk`).

`python -m espo_jax.bench attention [--quick] [--out FILE.json]`

1. Measured, side by side: the gradient of one `small` layer (the default experiment's
   attention: 8 heads of 32, 2 kv heads), batch 1, at T = 512, 1024, 2048 (256, 512 with
   `--quick`), unchunked vs chunks of 128 queries. Median seconds of the jitted gradient
   (timed alternately, so machine load hits both alike) and XLA's temporary memory from the
   compiled executable's memory analysis.
2. Compiled only (nothing is executed or allocated): one `qwen3_30b_a3b` layer (bf16, 32 heads
   of 128) at T = 4096 and 16384 (4096 with `--quick`), unchunked vs chunks of 1024: the
   temporary memory one sequence needs per layer in the backward pass (CPU XLA's buffer
   assignment, an estimate of an accelerator's).

Both use the layer's dense-MLP variant (`moe_every=0`) and a loss on the final hidden state, so
that neither the LM head's [T, V] logits nor the MoE dispatch hides the attention's share (on
CPU `lax.ragged_dot`, the 30B config's dispatch, lowers to a dense [E, rows, F] product that an
accelerator's grouped matmul does not make: 136 GiB for one 30B block at 4k tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from espo_jax.bench import format_table
from espo_jax.bench.model import interleaved_medians
from espo_jax.models import ModelConfig, forward, get_preset, init_params


def _hidden_loss(config: ModelConfig, params: dict, tokens_BxT: jax.Array) -> jax.Array:
    out = forward(config, params, tokens_BxT, return_hidden=True, return_logits=False)
    return jnp.mean(jnp.square(out.hidden.astype(jnp.float32))) + out.aux_loss


def compiled_grad(config: ModelConfig, seq_len: int):
    """The jitted gradient of `_hidden_loss` for [1, seq_len] tokens, compiled from shapes."""
    params = jax.eval_shape(lambda r: init_params(config, r), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return jax.jit(jax.grad(_hidden_loss, argnums=1), static_argnums=0).lower(
        config, params, tokens).compile()


def _temp_bytes(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def measured(seq_lens: tuple[int, ...], chunk: int, repeats: int) -> list[dict]:
    base = get_preset("small").replace(n_layers=1, moe_every=0, max_seq_len=max(seq_lens))
    params = init_params(base, jax.random.key(0))
    rows = []
    for t in seq_lens:
        tokens = jax.random.randint(jax.random.key(1), (1, t), 0, base.vocab_size)
        configs = {"full": base, "chunked": base.replace(attention_chunk=chunk)}
        grads = {name: compiled_grad(cfg, t) for name, cfg in configs.items()}
        fns = {}
        for name, grad in grads.items():
            grad(params, tokens)  # warm-up
            fns[name] = lambda grad=grad, tokens=tokens: jax.block_until_ready(
                grad(params, tokens))
        seconds = interleaved_medians(fns, repeats)
        rows.append({"seq_len": t, "chunk": chunk,
                     "full_s": seconds["full"], "chunked_s": seconds["chunked"],
                     "full_temp_bytes": _temp_bytes(grads["full"]),
                     "chunked_temp_bytes": _temp_bytes(grads["chunked"])})
    return rows


def qwen3_layer(seq_lens: tuple[int, ...], chunk: int) -> list[dict]:
    full = get_preset("qwen3_30b_a3b").replace(n_layers=1, moe_every=0, vocab_size=1024)
    chunked = full.replace(attention_chunk=chunk)
    return [{"seq_len": t, "chunk": chunk,
             "full_temp_bytes": _temp_bytes(compiled_grad(full, t)),
             "chunked_temp_bytes": _temp_bytes(compiled_grad(chunked, t))}
            for t in seq_lens]


def run(quick: bool) -> dict:
    small = measured((256, 512) if quick else (512, 1024, 2048), chunk=128,
                     repeats=3 if quick else 7)
    mib = 2.0**-20
    print("one `small` layer (dense MLP), gradient, batch 1 (measured):")
    print(format_table(
        ["T", "chunk", "full s", "chunked s", "time ratio", "full temp MiB", "chunked temp MiB",
         "memory ratio"],
        [[r["seq_len"], r["chunk"], r["full_s"], r["chunked_s"], r["chunked_s"] / r["full_s"],
          r["full_temp_bytes"] * mib, r["chunked_temp_bytes"] * mib,
          r["chunked_temp_bytes"] / r["full_temp_bytes"]] for r in small]))
    big = qwen3_layer((4096,) if quick else (4096, 16384), chunk=1024)
    gib = 2.0**-30
    print("\none `qwen3_30b_a3b` layer (dense MLP), gradient, one sequence (compiled only):")
    print(format_table(
        ["T", "chunk", "full temp GiB", "chunked temp GiB", "memory ratio"],
        [[r["seq_len"], r["chunk"], r["full_temp_bytes"] * gib, r["chunked_temp_bytes"] * gib,
          r["chunked_temp_bytes"] / r["full_temp_bytes"]] for r in big]))
    return {"small_layer": small, "qwen3_30b_a3b_layer": big}
