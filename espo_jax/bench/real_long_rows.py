"""bench real's update at the lengths RL trains on: rows of LONG_ROWS tokens against torch.

bench real's main update comparison trains rows of a prompt and a 32-token answer (78 tokens);
RL responses run to hundreds or thousands of tokens, where attention and the vocabulary
projection weigh differently. Here, for each row length L, LONG_PROMPTS prompts x LONG_SAMPLES
samples (4 rows) of the fp32 engine, each response cut to L + 1 - prompt tokens (the row's
inputs are L tokens), one ESPO update in one micro-batch, rows unpacked, fp32, one AdamW step:
espo_jax's `Learner` against the same update in transformers + torch
(`peer_process.torch_espo_stepper`), medians of the repeats after a warm-up call, each side's
peak resident memory. The sides run one after the other, not in turns: at 1024 tokens the two
together (~16 GB for espo_jax's process, ~9 GB for torch's, neither recomputing activations)
exceed a 24 GiB machine.
"""

from __future__ import annotations

import gc
from typing import Any

import jax

from espo_jax.bench import median_time
from espo_jax.bench.peer_process import PeerProcess, peak_rss, reset_peak_rss
from espo_jax.bench.real_workload import (
    LEARNING_RATE,
    learner_update,
    make_engine,
    rl_batch,
    rl_config,
    torch_rows,
)
from espo_jax.models.config import ModelConfig
from espo_jax.models.flops import train_flops_per_token

LONG_ROWS = (256, 1024)
QUICK_LONG_ROWS = (64, 128)
LONG_PROMPTS, LONG_SAMPLES = 2, 2


def long_rows(config: ModelConfig, params: dict, model_dir: str, prompts: list[list[int]],
              quick: bool, peer_env: dict, peak: float, repeats: int) -> dict:
    """{"rows": LONG_PROMPTS * LONG_SAMPLES, "lengths": {L: figures}} (module docstring);
    `peak`: the fp32 matmul peak the FLOP/s are set against."""
    prompts = prompts[:LONG_PROMPTS]
    prompt_len = len(prompts[0])
    rows = LONG_PROMPTS * LONG_SAMPLES
    out: dict[str, Any] = {"rows": rows, "lengths": {}}
    for length in QUICK_LONG_ROWS if quick else LONG_ROWS:
        new = length + 1 - prompt_len  # a row holds prompt + response less its last token
        engine = make_engine(config, params, rows, prompt_len, new, "fp32")
        groups, rewards = rl_batch(engine, prompts, LONG_SAMPLES, new)
        del engine
        cfg = rl_config(config, prompt_len, quick, shape=(LONG_PROMPTS, LONG_SAMPLES, new, 1))
        gc.collect()
        reset_peak_rss()
        learner, espo = learner_update(cfg, config, params, groups, rewards)
        secs = {"espo": median_time(espo, repeats)}  # the warm-up call compiles
        espo_peak = peak_rss().get("peak_rss")
        del learner, espo
        gc.collect()
        jax.clear_caches()
        with PeerProcess(peer_env) as peer:
            peer.request("rl_load", model_dir=model_dir, lr=LEARNING_RATE, micro_batches=1,
                         dtype="float32", alpha=cfg.loss.espo_alpha,
                         high_frac=cfg.loss.espo_high_entropy_frac,
                         **torch_rows(groups, rewards))
            secs["torch"] = median_time(lambda p=peer: p.request("train"), repeats)
            torch_peak = peer.request("memory").get("peak_rss")
        flops = train_flops_per_token(config, length) * rows * length
        out["lengths"][str(length)] = {
            "row_tokens": length, "espo_s": secs["espo"], "torch_s": secs["torch"],
            "espo_peak_rss": espo_peak, "torch_peak_rss": torch_peak,
            "espo_of_peak": flops / secs["espo"] / peak,
            "torch_of_peak": flops / secs["torch"] / peak,
            "espo_over_torch": secs["torch"] / secs["espo"]}
    return out
