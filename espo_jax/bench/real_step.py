"""bench real's RL step: espo_jax's whole step against TRL's `GRPOTrainer` at SmolLM2-135M-Instruct.

The same chat questions ("What is a + b + c?", the model's chat template) on both sides, group
size 8, the same new-token budget, temperature 1 without top-k / top-p, both sides stopping at
the model's end token, reward 1 when the last integer of the answer is the sum
(`trl_peer.chain_sum_reward`, one function for both), fp32 on both sides, one AdamW step per
batch at the same learning rate. espo_jax runs the update as experiments/smollm2_chain_sum.py
does (ESPO, rows packed, each prompt once per group; `rl_step.EspoStep`); TRL runs its GRPO loss
(beta 0, one iteration), which it has no ESPO for; the loss's own arithmetic is a negligible part
of either step. The two sides alternate, a step of espo_jax after each of TRL's (outside TRL's
timed window), medians after a warm-up step, each part's seconds and generated tokens beside the
step's, each side's peak resident memory.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from espo_jax.bench.peer_process import PeerProcess, peak_rss, reset_peak_rss
from espo_jax.bench.real_workload import rl_config
from espo_jax.bench.rl_step import PARTS, EspoStep
from espo_jax.bench.trl_peer import chain_sum_reward
from espo_jax.models.config import ModelConfig
from espo_jax.tokenizer import HFTokenizer


def real_config(config: ModelConfig, prompts: int, samples: int, new: int, lr: float,
                prompt_len: int) -> Any:
    """The ESPO step of experiments/smollm2_chain_sum.py at bench real's sizes (rows packed,
    each prompt once per group, one micro-batch, fp32 engine and learner, no anchor) at a
    constant learning rate `lr` without weight decay, as TRL's side runs."""
    c = rl_config(config, prompt_len, False, packed=True, shape=(prompts, samples, new, 1))
    c.optim.lr, c.optim.final_lr_frac, c.optim.weight_decay = lr, 1.0, 0.0
    return c


def _summary(steps: list[float], parts: list[dict]) -> dict:
    out = {"step_s": statistics.median(steps), "steps_s": steps}
    for name in (*PARTS, "completion_tokens", "reward_mean"):
        out[name] = statistics.median(p[name] for p in parts)
    out["completion_tokens_per_s"] = out["completion_tokens"] / out["generation_s"]
    return out


def real_rl_step(config: ModelConfig, params: dict, model_dir: str, questions: list[tuple],
                 eos_id: int, samples: int, new: int, lr: float, repeats: int,
                 peer_env: dict, tmp: str) -> dict:
    """bench real's RL-step section (module docstring). `questions`: (prompt ids, question
    text, answer) per prompt."""
    ids = [q[0] for q in questions]
    answers = [int(q[2]) for q in questions]
    decode = HFTokenizer(model_dir).decode

    def reward(i: int, tokens: np.ndarray) -> float:
        return chain_sum_reward(decode(tokens), answers[i])

    cfg = real_config(config, len(ids), samples, new, lr, max(len(p) for p in ids))
    reset_peak_rss()
    espo = EspoStep(cfg, config, params, ids, reward, stop_tokens=(eos_id,))
    t0 = time.perf_counter()
    espo.step()
    first_s = time.perf_counter() - t0
    espo_steps, espo_parts = [], []

    def espo_turn() -> None:  # after each TRL step, outside its timed window
        espo_steps.append(espo.step())
        espo_parts.append(espo.last)

    with PeerProcess(peer_env) as peer:
        trl = peer.trl(espo_turn, model_dir=model_dir, prompts=[q[1] for q in questions],
                       steps=1 + repeats, out_dir=os.path.join(tmp, "trl"), lr=lr,
                       new_tokens=new, samples=samples, answers=answers)
        trl_memory = peer.request("memory")
    espo_memory = peak_rss()
    if not len(trl["seconds"]) == len(espo_steps) == 1 + repeats:
        raise RuntimeError(f"RL-step turns out of step: {len(trl['seconds'])} TRL and "
                           f"{len(espo_steps)} espo_jax steps, {1 + repeats} expected")
    if trl["prompt_ids"] != list(ids[0]):
        raise RuntimeError("TRL rendered the first chat prompt as other tokens than espo_jax: "
                           f"{trl['prompt_ids']} != {list(ids[0])}")
    espo_side = {**_summary(espo_steps[1:], espo_parts[1:]), "first_step_s": first_s,
                 "warmup_step_s": espo_steps[0], "peak_rss": espo_memory.get("peak_rss")}
    trl_side = {**_summary(trl["seconds"][1:], trl["parts"][1:]),
                "first_step_s": trl["seconds"][0], "peak_rss": trl_memory.get("peak_rss"),
                "trl_threads": trl["trl_threads"]}
    return {"prompts": len(ids), "samples": samples, "new_tokens": new, "lr": lr,
            "repeats": repeats, "loss": {"espo": "espo (packed rows)", "trl": "grpo"},
            "sides": {"espo": espo_side, "trl": trl_side},
            "espo_over_trl": trl_side["step_s"] / espo_side["step_s"],
            "generation_over_trl": (espo_side["completion_tokens_per_s"]
                                    / trl_side["completion_tokens_per_s"])}
