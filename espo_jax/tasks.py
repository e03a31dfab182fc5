"""The task wiring of a run: prompt sources, the outcome verifier, the RL reward function and
the detokeniser, chosen by `config.data.name` (and `config.zve.tie_break.wrong_score`).

Neutral ground: the learner's loops and the rollout workers both build their rewards here, so a
worker scores its responses exactly as the single-process loop does.
"""

from __future__ import annotations

import functools
import os

from espo_jax.models.tokenizer import CharTokenizer
from espo_jax.rewards.verifiers import arith_step_credit, verify_arith, verify_math

_CHAR = CharTokenizer()


def char_decode(ids) -> str:
    """Module-level (picklable) detokeniser for reward-pool processes."""
    return _CHAR.decode(ids, errors="replace")


def arith_reward(text: str, answer: str) -> bool:
    return verify_arith(text, answer)


def arith_credit_reward(text: str, target: tuple[str, str]) -> dict:
    """The arith outcome plus `step_credit` (the worked solution's steps reproduced as a
    prefix), for `zve.tie_break.wrong_score="step_credit"`; `target` is (answer, solution)."""
    answer, solution = target
    ok = verify_arith(text, answer)
    return {"reward": float(ok), "outcome": ok, "step_credit": arith_step_credit(text, solution)}


def verifier(config):
    """The task's outcome check `(text, answer) -> bool` (held-out evaluation, RL rewards)."""
    return arith_reward if config.data.name == "arith_chains" else math_reward


def reward_fn(config):
    """(reward function, target of a prompt) of the RL rollouts: the task's verifier on
    `prompt["answer"]`, or with step credit on `(answer, solution)`."""
    if config.data.name == "arith_chains" and config.zve.tie_break.wrong_score == "step_credit":
        return arith_credit_reward, lambda p: (p["answer"], p["solution"])
    return verifier(config), None


def math_reward(text: str, answer: str) -> bool:
    return verify_math(text, answer, timeout_s=5.0)


def data_dir(config, workdir: str) -> str:
    return config.data.data_dir or os.path.join(workdir, "data")


def prompt_sources(config, workdir: str, tokenizer):
    """(RL train, warm-start, held-out test) prompts of `config.data`: TFDS builders prepared
    under `data_dir` on first use."""
    from espo_jax.data import prompts as prompts_lib

    root = data_dir(config, workdir)
    if config.data.name == "arith_chains":
        from espo_jax.data.arith_chains import arith_chains_config

        dcfg = arith_chains_config(levels=tuple(tuple(lv) for lv in config.data.levels),
                                   train_per_level=config.data.train_per_level,
                                   test_per_level=config.data.test_per_level, seed=config.seed,
                                   index_hints=config.data.index_hints)
        src = functools.partial(prompts_lib.arith_chains_source, config=dcfg)
        train = src(root, "train", tokenizer, levels=config.data.train_levels)
        warm = src(root, "train", tokenizer, levels=config.warmstart.levels)
        test = src(root, "test", tokenizer, levels=config.data.eval_levels)
        return train, warm, test
    from espo_jax.data.math_jsonl import math_jsonl_config

    dcfg = math_jsonl_config(train=config.data.jsonl_train, test=config.data.jsonl_test)
    kw = dict(config=dcfg, max_prompt_tokens=config.rollout.max_prompt_len)
    train = prompts_lib.math_jsonl_source(root, "train", tokenizer, **kw)
    test = prompts_lib.math_jsonl_source(root, "test", tokenizer, **kw)
    return train, train, test


def decoder(config, tokenizer):
    """The detokeniser of reward-pool processes: the module-level `char_decode` for the
    character tokenizer (picklable), else the tokenizer's own `decode`."""
    return char_decode if config.tokenizer == "char" else tokenizer.decode
