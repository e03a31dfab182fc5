"""One whole RL step of espo_jax: `EspoStep`, the single-process loop's step without its buffer.

The embedded engine samples a group per prompt (behaviour log-probs and, for an MoE, routing
recorded), a reward per response, the `Learner`'s update; each part timed. bench peers runs it on
its random Qwen3-MoE workload, bench real (`espo_jax.bench.real_step`) at SmolLM2-135M-Instruct,
each against TRL's `GRPOTrainer` (`espo_jax.bench.trl_peer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax import sharding
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.models.config import ModelConfig
from espo_jax.rollout.engine import Engine, Request, auto_shards
from espo_jax.rollout.sampling import SamplingConfig
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
        self.last = {"generation_s": t1 - t0, "reward_s": t2 - t1,
                     "update_s": t3 - t2, "loss": metrics.get("train/loss", float("nan")),
                     "reward_mean": float(np.mean(np.concatenate(rewards))),
                     "completion_tokens": int(sum(len(x.tokens) for g in generated
                                                  for x in g.responses))}
        return t3 - t0
