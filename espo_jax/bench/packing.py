"""Sequence packing against one row per sequence: the learner's update on the same sequences.

The default experiment's update shape: 256 sequences (32 prompts x 8 samples) in rows of 71
positions (20 prompt + 52 response - 1), the `small` preset, ESPO with router replay. Prompt
lengths are drawn from 8-20 tokens and response lengths from 10-52 (about 36% of the padded
positions are padding, as in the default run), 8 responses per prompt. The same sequences go
through `pack_sequences` three ways (one row per sequence, packed, packed with each prompt
once: `share_prompts`), and the fused ESPO loss + gradients + AdamW update runs on each, timed in
alternation (medians of repeats), compile apart; the packed rows also with attention in 4
query blocks that skip the keys after them (`model.causal_blocks=4`). The
gradients agree (tests/train/test_packing.py, tests/models/test_model.py); this measures only
the time. Last, the update as the learner runs it (`train.grad_threads` parts of the rows,
balanced by tokens with each prompt's responses together, each packed with shared prompts,
their gradients at once on as many threads, joined into one AdamW update), and each layout's
achieved model FLOP/s (PaLM's 6N + 12LHAT per computed real token, `models.flops`) against the
peak of a jitted fp32 `jnp.dot` measured in the same process.

    python -m espo_jax.bench packing [--quick] [--out FILE.json]
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax

from espo_jax import configs
from espo_jax.bench import format_table
from espo_jax.bench.model import interleaved_medians, peak_matmul_flops
from espo_jax.models import get_preset, init_params
from espo_jax.models.flops import train_flops_per_token
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.train import step as step_lib
from espo_jax.train.accumulation import join_parts
from espo_jax.train.batch import balanced_parts, pack_sequences, prompt_keys

PROMPT_LEN, NEW_TOKENS = 20, 52
N_BLOCKS = 4
BLOCKS = f"packed, attention in {N_BLOCKS} causal blocks"
SAMPLES = 8  # responses per prompt (the default experiment's G)
SHARED = "packed, shared prompts"
LEARNER = "learner: shared prompts, {n} gradient threads"


def sequences(config, n: int, *, prompt_len: tuple[int, int] = (8, PROMPT_LEN),
              response_len: tuple[int, int] = (10, NEW_TOKENS), max_len: int | None = None,
              seed: int = 0, group: int = 1):
    """`n` random prompt + response pairs (lengths uniform in the inclusive ranges; with
    `max_len`, responses cut to fit it), recorded routing of distinct experts on every token
    but the last, behaviour log-probs near -3, normal advantages, no RL-ZVP signs: the
    arguments of `pack_sequences`. `group`: consecutive pairs share their prompt (and its
    recorded routing) this many at a time. Defaults: the default experiment's lengths."""
    rng = np.random.default_rng(seed)
    prompts, responses, blogps, routings = [], [], [], []
    for i in range(n):
        if i % group == 0:
            p = rng.integers(3, config.vocab_size, rng.integers(prompt_len[0], prompt_len[1] + 1))
            p_route = np.stack([rng.permutation(config.n_experts)[:config.top_k]
                                for _ in range(len(p) * config.n_moe_layers)])
        r_max = response_len[1] if max_len is None else min(response_len[1], max_len - len(p))
        r = rng.integers(3, config.vocab_size, rng.integers(response_len[0], r_max + 1))
        route = np.stack([rng.permutation(config.n_experts)[:config.top_k]
                          for _ in range(len(r) * config.n_moe_layers)] or
                         [np.zeros((0, config.top_k), np.int64)]).reshape(-1, config.top_k)
        route = np.concatenate([p_route, route]).reshape(len(p) + len(r), config.n_moe_layers,
                                                         config.top_k)
        route[-1] = -1
        prompts.append(p), responses.append(r), routings.append(route)
        blogps.append(rng.normal(-3.0, 0.3, len(r)).astype(np.float32))
    adv = rng.normal(size=n).astype(np.float32)
    return prompts, responses, blogps, routings, adv, np.zeros(n, np.float32)


def espo_update(config, lr: float = 1e-4):
    """(update, optimizer): the learner's fused ESPO + R3 update with AdamW, jitted:
    `update(params, opt_state, batch) -> (params, opt_state, loss)`."""
    loss_config = paper_loss_config("espo")
    loss_config.vocab_size = config.vocab_size
    loss_fn = functools.partial(step_lib.rl_loss, model_config=config, replay="r3",
                                chunk_size=64, loss_config=loss_config, zvp_alpha=0.0,
                                fused=True)
    tx = optax.adamw(lr)

    @functools.partial(jax.jit, compiler_options=step_lib.compiler_options())
    def update(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return update, tx


def threaded_update(config, args, kw, threads: int, lr: float = 1e-4):
    """(blocking update(), [parts' batches]): the update as the learner makes it with
    `train.grad_threads` = threads: the sequences split into `threads` parts of rows / threads
    rows by tokens with each prompt's responses in one part (`batch.balanced_parts`), each
    part packed with shared prompts, their `rl_part_gradients` at once on as many threads,
    `join_parts` and one AdamW update."""
    prompts, responses, *_ = args
    rows = kw["rows"] // threads
    parts = []
    for mine in balanced_parts([len(p) + len(r) for p, r in zip(prompts, responses, strict=True)],
                               threads, rows, prompt_keys(prompts, args[3])):
        part_args = [[a[i] for i in mine] for a in args[:4]] + [a[mine] for a in args[4:]]
        parts.append(jax.tree.map(jnp.asarray, pack_sequences(
            *part_args, **{**kw, "rows": rows}, pack=True, share_prompts=True)))
    loss_config = paper_loss_config("espo")
    loss_config.vocab_size = config.vocab_size
    options = step_lib.compiler_options()
    grad = jax.jit(functools.partial(
        step_lib.rl_part_gradients, model_config=config, loss_config=loss_config,
        replay="r3", chunk_size=64, zvp_alpha=0.0, n_micro=1, fused=True),
        compiler_options=options)
    tx = optax.adamw(lr)

    @functools.partial(jax.jit, compiler_options=options)
    def apply(params, opt_state, outs):
        loss, grads, _ = join_parts(outs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = init_params(config, jax.random.key(0))
    opt_state = tx.init(params)
    pool = ThreadPoolExecutor(threads)

    def update():
        outs = list(pool.map(lambda b: jax.block_until_ready(grad(params, b)), parts))
        return jax.block_until_ready(apply(params, opt_state, outs))

    return update, parts


def run(quick: bool) -> dict:
    config = get_preset("tiny" if quick else "small")
    rows = 32 if quick else 256
    repeats = 3 if quick else 7
    seq_len = PROMPT_LEN + NEW_TOKENS - 1
    args = sequences(config, rows, group=SAMPLES)
    kw = dict(rows=rows, seq_len=seq_len, pad_id=0,
              moe_shape=(config.n_moe_layers, config.top_k))
    batches = {"padded": pack_sequences(*args, **kw, pack=False),
               "packed": pack_sequences(*args, **kw, pack=True),
               SHARED: pack_sequences(*args, **kw, pack=True, share_prompts=True)}
    # The packed rows again with attention in 4 query blocks that skip the keys after them
    # (`model.causal_blocks=4`) against the preset's one block.
    batches[BLOCKS] = batches["packed"]
    update, tx = espo_update(config)
    updates = {"padded": update, "packed": update, SHARED: update,
               BLOCKS: espo_update(config.replace(causal_blocks=N_BLOCKS))[0]}
    params = init_params(config, jax.random.key(0))
    opt_state = tx.init(params)
    fns, figures = {}, {"preset": "tiny" if quick else "small", "sequences": rows,
                        "seq_len": seq_len, "repeats": repeats,
                        "causal_blocks": N_BLOCKS}
    for name, batch in batches.items():
        update = updates[name]
        batch = jax.tree.map(jnp.asarray, batch)
        n_real = int(np.sum(np.asarray(batch.segment_ids) > 0))
        start = time.perf_counter()
        compiled = update.lower(params, opt_state, batch).compile()
        compile_s = time.perf_counter() - start
        loss = float(compiled(params, opt_state, batch)[2])
        fns[name] = functools.partial(
            lambda c, b: jax.block_until_ready(c(params, opt_state, b)), compiled, batch)
        figures[name] = {"model_rows": int(batch.tokens.shape[0]),
                         "row_len": int(batch.tokens.shape[1]),
                         "token_slots": int(batch.tokens.size), "real_tokens": n_real,
                         "padding_frac": 1 - n_real / batch.tokens.size,
                         "compile_s": compile_s, "loss": loss}
    threads = configs.default_config().train.grad_threads
    learner = LEARNER.format(n=threads)
    fns[learner], parts = threaded_update(config, args, kw, threads)
    start = time.perf_counter()
    loss = float(fns[learner]()[2])
    figures[learner] = {
        "model_rows": sum(int(b.tokens.shape[0]) for b in parts),
        "row_len": int(parts[0].tokens.shape[1]),
        "token_slots": sum(int(b.tokens.size) for b in parts),
        "real_tokens": sum(int(np.sum(np.asarray(b.segment_ids) > 0)) for b in parts),
        "compile_s": time.perf_counter() - start, "loss": loss, "grad_threads": threads}
    figures[learner]["padding_frac"] = (1 - figures[learner]["real_tokens"]
                                        / figures[learner]["token_slots"])
    secs = interleaved_medians(fns, repeats)
    peak = peak_matmul_flops(1024 if quick else 2048, 3 if quick else 10)
    figures["peak_matmul_flops"] = peak
    for name in fns:
        f = figures[name]
        f["update_s"] = secs[name]
        f["model_flops"] = train_flops_per_token(config, f["row_len"]) * f["real_tokens"]
        f["of_peak"] = f["model_flops"] / secs[name] / peak
    figures["packed_speedup"] = secs["padded"] / secs["packed"]
    figures["shared_speedup"] = secs["packed"] / secs[SHARED]
    figures["causal_blocks_speedup"] = secs["packed"] / secs[BLOCKS]
    figures["load_average"] = os.getloadavg()
    rows_out = [[name, f"{f['model_rows']} x {f['row_len']}", f["token_slots"],
                 f"{100 * f['padding_frac']:.1f}%", f"{f['update_s']:.3f}",
                 f"{100 * f['of_peak']:.1f}%", f"{f['compile_s']:.1f}", f"{f['loss']:.6f}"]
                for name, f in ((n, figures[n]) for n in fns)]
    print(f"{figures['preset']}: {rows} sequences, ESPO + R3 fused update with AdamW; medians "
          f"of {repeats}, interleaved; load average {figures['load_average'][0]:.1f}; "
          f"jnp.dot peak {peak / 1e9:.0f} GFLOP/s")
    print(format_table(["layout", "model rows x width", "token slots", "padding",
                        "update s", "model FLOP/s of peak", "compile s", "loss"], rows_out))
    print(f"packed update: {figures['packed_speedup']:.2f}x the padded one's speed; shared "
          f"prompts: {figures['shared_speedup']:.2f}x the packed one's; attention in "
          f"{N_BLOCKS} causal blocks: {figures['causal_blocks_speedup']:.2f}x one block's")
    return figures
