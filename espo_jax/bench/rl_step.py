"""One whole RL step of espo_jax against one of TRL's `GRPOTrainer`.

`EspoStep` is the single-process loop's step without its buffer: the embedded engine samples a
group per prompt (behaviour log-probs and, for an MoE, routing recorded), a reward per response,
the `Learner`'s update. bench peers runs it on its random Qwen3-MoE workload; `real_rl_step` is
bench real's section at SmolLM2-135M-Instruct: the same chat questions ("What is a + b + c?",
the model's chat template) on both sides, group size 8, the same new-token budget, temperature 1
without top-k / top-p, both sides stopping at the model's end token, reward 1 when the last
integer of the answer is the sum (`trl_peer.chain_sum_reward`, one function for both), fp32 on
both sides, one AdamW step per batch at the same learning rate. espo_jax runs the update as
experiments/smollm2_chain_sum.py does (ESPO, rows packed, each prompt once per group); TRL runs
its GRPO loss (beta 0, one iteration), which it has no ESPO for; the loss's own arithmetic is a
negligible part of either step. The two sides alternate, a step of espo_jax after each of TRL's
(outside TRL's timed window), medians after a warm-up step, each part's seconds and generated
tokens beside the step's, each side's peak resident memory.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax import configs, sharding
from espo_jax.bench.peer_process import PeerProcess, peak_rss, reset_peak_rss
from espo_jax.bench.trl_peer import chain_sum_reward
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.models.config import ModelConfig
from espo_jax.rollout.engine import Engine, Request, auto_shards
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.tokenizer import HFTokenizer
from espo_jax.train import state as state_lib
from espo_jax.train.learner import Learner

PARTS = ("generation_s", "reward_s", "update_s")


class EspoStep:
    """Engine rollout, rewards and the Learner's update of `config` (its prompts per step,
    samples, new tokens, engine precision, loss and optimizer) on `prompts`; `reward(i, tokens)`
    scores a response of prompt i. `step()` returns its seconds; `last` holds its parts."""

    def __init__(self, config, model_config: ModelConfig, params: dict,
                 prompts: list[list[int]], reward: Callable[[int, np.ndarray], float],
                 stop_tokens: tuple[int, ...] = ()):
        self.config = c = config
        self.model_config = model_config
        self.reward = reward
        samples, new = c.zve.n_samples, c.rollout.max_new_tokens
        mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:1])
        tx = state_lib.make_optimizer(c.optim, 1000)
        self.state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))(
            jax.tree.map(jnp.asarray, params))
        self.learner = Learner(c, model_config, mesh, jax.tree.map(lambda x: x.sharding,
                                                                   self.state))
        slots = len(prompts) * samples
        shards = c.rollout.engine_shards or auto_shards(slots)
        self.engine = Engine(model_config, sampling=SamplingConfig(
            temperature=1.0, max_new_tokens=new, stop_tokens=stop_tokens), max_slots=slots,
            steps_per_sync=c.rollout.steps_per_sync,
            prefill_rows=max(1, len(prompts) // shards),  # one prefill call per shard
            max_cache_len=max(len(p) for p in prompts) + new, precision=c.rollout.precision,
            shards=shards)
        self.requests = [Request(prompt_id=str(i), tokens=p, n_samples=samples)
                         for i, p in enumerate(prompts)]
        self.steps = 0
        self.last: dict[str, float] = {}

    def step(self) -> float:
        t0 = time.perf_counter()
        self.engine.load_params(self.state.params)
        generated = self.engine.generate_groups(
            self.requests, rng=jax.random.fold_in(jax.random.key(1), self.steps))
        t1 = time.perf_counter()
        rewards = [np.array([self.reward(int(g.prompt_id), x.tokens) for x in g.responses],
                            np.float32) for g in generated]
        t2 = time.perf_counter()
        groups = [RolloutGroup(
            prompt_id=g.prompt_id, prompt_tokens=np.asarray(g.prompt_tokens, np.int32),
            policy_version=self.steps, sampler=self.engine.sampler_name,
            created_at=time.time(), rewarded_at=time.time(), responses=[
                Response(tokens=x.tokens, logprobs=x.logprobs, routed_experts=x.routed_experts,
                         finish_reason=x.finish_reason, outcome=bool(v > 0.5), reward=float(v))
                for x, v in zip(g.responses, r, strict=True)],
            n_experts=self.model_config.n_experts) for g, r in zip(generated, rewards, strict=True)]
        self.state, metrics = self.learner.update(self.state, groups, rewards)
        jax.block_until_ready(self.state)
        self.steps += 1
        t3 = time.perf_counter()
        self.last = {"rollout_s": t1 - t0, "generation_s": t1 - t0, "reward_s": t2 - t1,
                     "update_s": t3 - t2, "loss": metrics.get("train/loss", float("nan")),
                     "reward": float(np.mean(np.concatenate(rewards))),
                     "completion_tokens": int(sum(len(x.tokens) for g in generated
                                                  for x in g.responses))}
        return t3 - t0


def real_config(config: ModelConfig, prompts: int, samples: int, new: int, lr: float,
                prompt_len: int) -> Any:
    """The ESPO step of experiments/smollm2_chain_sum.py at bench real's sizes: rows packed,
    each prompt once per group, one micro-batch, fp32 engine and learner, no anchor."""
    c = configs.default_config()
    c.loss.name = "espo"
    c.loss.vocab_size = config.vocab_size
    c.rollout.prompts_per_step, c.zve.n_samples = prompts, samples
    c.rollout.max_prompt_len, c.rollout.max_new_tokens = prompt_len, new
    c.rollout.precision = "fp32"
    c.train.updates_per_batch, c.train.micro_batches = 1, 1
    c.train.pack, c.train.share_prompts, c.train.anchor_coef = True, True, 0.0
    c.optim.lr, c.optim.warmup_steps, c.optim.final_lr_frac = lr, 0, 1.0
    c.optim.weight_decay = 0.0
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
        espo_parts.append({**espo.last, "reward_mean": espo.last["reward"]})

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
