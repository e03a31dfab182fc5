"""Supervised warm start: cross-entropy on worked solutions of the easy levels.

The policy first learns the answer format and the step pattern (`57+87=144,144-70=74#74`) where
it is easy; RL then trains on every level. Stops early once greedy accuracy on held-out-free
samples of its own levels reaches `warmstart.target_accuracy`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from espo_jax import console
from espo_jax.train import state as state_lib
from espo_jax.train import step as step_lib
from espo_jax.train.batch import rl_seq_len


def sft_batch(prompts: Sequence[dict], idx: np.ndarray, tokenizer, seq_len: int) -> dict:
    """`bos + prompt + solution + eos` rows; the loss covers solution and eos targets."""
    rows = len(idx)
    tokens = np.zeros((rows, seq_len), np.int32)
    targets = np.zeros((rows, seq_len), np.int32)
    mask = np.zeros((rows, seq_len), np.float32)
    for r, i in enumerate(idx):
        p = prompts[int(i)]
        prompt = list(p["tokens"])
        full = prompt + tokenizer.encode(p["solution"]) + [tokenizer.eos_id]
        if len(full) > seq_len + 1:
            raise ValueError(f"warm-start example {p['prompt_id']!r} has {len(full)} tokens > "
                             f"seq_len + 1 = {seq_len + 1}; raise rollout.max_new_tokens")
        n = len(full) - 1
        tokens[r, :n] = full[:-1]
        targets[r, :n] = full[1:]
        mask[r, len(prompt) - 1 : n] = 1.0
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
    return {"tokens": tokens, "targets": targets, "mask": mask, "positions": positions}


def warm_seq_len(prompts: Sequence[dict], tokenizer, cap: int) -> int:
    """Input columns of the warm-start rows: the longest `bos + prompt + solution` (the eos is a
    target only), rounded up to a multiple of 8, at most `cap` (the RL sequence length). The
    easy levels' solutions are short: padding them to the RL length would cost every step."""
    longest = max(len(p["tokens"]) + len(tokenizer.encode(p["solution"])) for p in prompts)
    return min(-(-longest // 8) * 8, cap)


def warm_start(
    setup,
    params,
    *,
    evaluate_fn: Callable[[dict], dict],
    log: Callable[[int, dict], None],
):
    """Trains `params` on worked solutions; returns (params, last eval metrics plus
    `warmstart/steps` and `warmstart/seconds`, what it ran)."""
    config, ws = setup.config, setup.config.warmstart
    seq_len = warm_seq_len(setup.warm_prompts, setup.tokenizer, rl_seq_len(config))
    optim = config.optim.copy_and_resolve_references()
    optim.lr = ws.lr
    tx = state_lib.make_optimizer(optim, ws.steps)
    state = state_lib.create_train_state(params, tx, jax.random.key(config.seed))
    step_fn = jax.jit(
        functools.partial(
            step_lib.sft_train_step,
            model_config=setup.model_config,
            chunk_size=config.train.logprob_chunk,
            n_micro=1,
        ),
        donate_argnums=(0,), compiler_options=step_lib.compiler_options(setup.model_config),
    )
    rng = np.random.default_rng(config.seed)
    eval_metrics: dict = {}
    start = time.time()
    progress = console.Progress("warm start", ws.steps)
    for step in range(ws.steps):
        idx = rng.integers(0, len(setup.warm_prompts), size=ws.batch_size)
        batch = sft_batch(setup.warm_prompts, idx, setup.tokenizer, seq_len)
        state, metrics = step_fn(state, batch)
        last = step + 1 == ws.steps
        if (step + 1) % 25 == 0 and not last:  # the last step's line comes with its evaluation
            logging.info("warm start step %d/%d: nll %.3f (%.2f s/step so far)", step + 1,
                         ws.steps, float(metrics["sft/nll"]), (time.time() - start) / (step + 1),
                         extra=console.FILE_ONLY)
            progress.update(step + 1, {"nll": float(metrics["sft/nll"]),
                                       **({"acc": eval_metrics["eval/accuracy"]}
                                          if eval_metrics else {})})
        out_of_time = bool(ws.max_seconds) and time.time() - start >= ws.max_seconds
        if (step + 1) % ws.eval_every == 0 or last or out_of_time:
            eval_metrics = evaluate_fn(state.params)
            metrics = {**jax.device_get(metrics), **eval_metrics}
            log(step + 1, metrics)
            acc = eval_metrics.get("eval/accuracy", 0.0)
            logging.info("warm start %d/%d: nll %.3f, accuracy on its levels %.3f (%.0f s)",
                         step + 1, ws.steps, float(metrics["sft/nll"]), acc, time.time() - start,
                         extra=console.FILE_ONLY)
            progress.update(step + 1 if not last else ws.steps,
                            {"nll": float(metrics["sft/nll"]), "acc": acc})
            if acc >= ws.target_accuracy:
                break
        if out_of_time:
            logging.info("warm start: the %.0f s budget is spent after %d steps", ws.max_seconds,
                         step + 1)
            break
    done = {"warmstart/steps": step + 1 if ws.steps else 0,
            "warmstart/seconds": time.time() - start}
    return state.params, {**eval_metrics, **done}
