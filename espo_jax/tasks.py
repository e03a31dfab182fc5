"""Tasks: what a run learns from. A task is prompt splits and a reward function.

The task sources are here: the built-in TFDS tasks (`arith_chains`, `math_jsonl`), reasoning-gym
datasets (`reasoning_gym_task`), JSONL / Parquet prompt files (`prompt_files`), and the rewards
they use; `espo_jax.task_loading` resolves `config.task` to one of them (or to a task function of
your own), and `espo_jax.task_prompts` tokenises its prompts for the engine.

A prompt is a dict with `prompt` (text, or chat messages `[{"role", "content"}]` that go through
the tokenizer's chat template) and whatever fields the reward needs; `prompt_id` (default
"{split}/{index}"), `level` (default 0) and `solution` (a worked solution for the supervised warm
start and the anchor; default "") are optional. The reward maps `(prompt, completion text)` to a
bool (the outcome; reward 1 or 0), a number (the reward; outcome = reward > 0) or a dict with
"reward" and "outcome" and optional numeric components. The outcome is what MS-ZVE filters on;
the reward may be shaped. It runs in the reward pool's processes, so it must be importable by
name (defined at module level), or the pool's threads (`rollout.reward_backend="thread"`). It is
tried once on a train and a held-out prompt before any work (`task_prompts.check_reward`); later,
a reward that raises or times out is counted, logged with the task, the prompt id and its
traceback, and stops the run past `rollout.max_failed_reward_frac`.

Neutral ground: the learner's loops and the rollout workers both build their task here, so a
worker scores its responses exactly as the single-process loop does.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from espo_jax import extras
from espo_jax.data.jsonl import json_objects
from espo_jax.rewards.pool import normalize_reward
from espo_jax.rewards.verifiers import arith_step_credit, verify_arith, verify_math
from espo_jax.tokenizer import CharTokenizer

_CHAR = CharTokenizer()
SPLIT_SEED_STRIDE = 1_000_003  # reasoning-gym seeds of a task's splits lie this far apart


@dataclasses.dataclass(frozen=True)
class Task:
    """Prompt splits and a reward; see the module doc for the prompt and reward contracts.

    `warm` are the prompts of the supervised warm start (default: `train`); `validation` is
    where hyperparameters are chosen (`--config.eval.split=validation`), `test` is read for
    final numbers only.
    """

    reward: Callable[[Mapping, str], Any]
    train: Sequence[Mapping]
    test: Sequence[Mapping]
    validation: Sequence[Mapping] = ()
    warm: Sequence[Mapping] | None = None
    name: str = ""


# ---- rewards: (prompt, text) -> outcome / reward; module level, so the pool can pickle them --
def arith_reward(prompt: Mapping, text: str) -> bool:
    return verify_arith(text, prompt["answer"])


def arith_credit_reward(prompt: Mapping, text: str) -> dict:
    """The arith outcome plus `step_credit` (the worked solution's steps reproduced as a
    prefix), for `zve.tie_break.wrong_score="step_credit"`."""
    ok = verify_arith(text, prompt["answer"])
    return {"reward": float(ok), "outcome": ok,
            "step_credit": arith_step_credit(text, prompt["solution"])}


def math_reward(prompt: Mapping, text: str) -> bool:
    return verify_math(text, prompt["answer"], timeout_s=5.0)


def _last_line(text: str) -> str | None:
    """The completion's last non-empty line, stripped (None for an empty completion)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def exact_reward(prompt: Mapping, text: str) -> bool:
    """The completion's last non-empty line equals `prompt["answer"]` (stripped)."""
    return _last_line(text) == str(prompt["answer"]).strip()


NAMED_REWARDS = {"arith": arith_reward, "math": math_reward, "exact": exact_reward}


class PromptReward:
    """The reward pool's `(text, target)` contract over a task reward `(prompt, text)`: the
    target of a response is its prompt dict (without token ids)."""

    def __init__(self, fn: Callable[[Mapping, str], Any]):
        self.fn = fn

    def __call__(self, text: str, prompt: Mapping) -> Any:
        return self.fn(prompt, text)

    def warmup(self) -> None:
        """The task reward's own `warmup()`, if it has one (see `rewards.pool`)."""
        if callable(getattr(self.fn, "warmup", None)):
            self.fn.warmup()


def reward_target(prompt: Mapping) -> dict:
    """What a prompt's reward sees in the pool: the prompt dict without its token ids."""
    return {k: v for k, v in prompt.items() if k != "tokens"}


def outcome_fn(task: Task) -> Callable[[Mapping, str], bool]:
    """`(prompt, text) -> outcome` of held-out evaluation, in this process; a reward that raises
    is an error naming the task and the prompt."""

    def outcome(prompt: Mapping, text: str) -> bool:
        try:
            return normalize_reward(task.reward(reward_target(prompt), text))[1]
        except Exception as e:
            raise RuntimeError(f"task {task.name!r}: the reward failed on evaluation prompt "
                               f"{prompt.get('prompt_id')!r}: {type(e).__name__}: {e}") from e

    return outcome


# ---- built-in tasks ----------------------------------------------------------------------------
def data_dir(config, workdir: str) -> str:
    return config.data.data_dir or os.path.join(workdir, "data")


def arith_chains_task(config, workdir: str, tokenizer) -> Task:
    """`arith_chains` (TFDS, prepared under `data_dir`): RL on `data.train_levels`, warm start
    on `warmstart.levels`, validation and test on `data.eval_levels`."""
    from espo_jax.data import prompts as prompts_lib
    from espo_jax.data.arith_chains import arith_chains_config

    dcfg = arith_chains_config(levels=tuple(tuple(lv) for lv in config.data.levels),
                               train_per_level=config.data.train_per_level,
                               test_per_level=config.data.test_per_level, seed=config.seed,
                               index_hints=config.data.index_hints,
                               validation_per_level=config.data.validation_per_level)
    src = functools.partial(prompts_lib.arith_chains_source, data_dir(config, workdir),
                            tokenizer=tokenizer, config=dcfg)
    credit = config.zve.tie_break.wrong_score == "step_credit"
    return Task(reward=arith_credit_reward if credit else arith_reward,
                train=src("train", levels=config.data.train_levels),
                test=src("test", levels=config.data.eval_levels),
                validation=(src("validation", levels=config.data.eval_levels)
                            if config.data.validation_per_level else ()),
                warm=src("train", levels=config.warmstart.levels), name="arith_chains")


def math_jsonl_task(config, workdir: str, tokenizer) -> Task:
    """`math_jsonl` (TFDS over `data.jsonl_train` / `data.jsonl_test`), math-verify rewards."""
    from espo_jax.data import prompts as prompts_lib
    from espo_jax.data.math_jsonl import math_jsonl_config

    dcfg = math_jsonl_config(train=config.data.jsonl_train, test=config.data.jsonl_test)
    kw = dict(config=dcfg, max_prompt_tokens=config.rollout.max_prompt_len or None)
    root = data_dir(config, workdir)
    return Task(reward=math_reward, train=prompts_lib.math_jsonl_source(root, "train", tokenizer,
                                                                        **kw),
                test=prompts_lib.math_jsonl_source(root, "test", tokenizer, **kw),
                name="math_jsonl")


ANSWER_FORMATS = ("last_line", "last_number")


class ReasoningGymReward:
    """A reasoning-gym scorer as a task reward. The answer is the text inside the last
    `<answer>...</answer>` tags, else (`answer_format`) the completion's last non-empty line or
    its last number; the reward is the scorer's value in [0, 1] (partial credit where the
    dataset gives it), the outcome whether it is 1. Picklable (by dataset name), so it runs in
    the reward pool's processes."""

    def __init__(self, name: str, answer_format: str = "last_line"):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"reasoning_gym:{name}: answer_format {answer_format!r} is not one "
                             f"of {ANSWER_FORMATS}")
        self.name, self.answer_format = name, answer_format

    @functools.cached_property
    def _score(self):
        import reasoning_gym

        return reasoning_gym.get_score_answer_fn(self.name)

    def __getstate__(self):
        return {"name": self.name, "answer_format": self.answer_format}

    def warmup(self) -> None:
        """Imports reasoning-gym and builds the scorer (~1 s on a quiet 2-core CPU, several
        under load): done once per reward worker, not inside the first response's timeout."""
        from reasoning_gym.utils import extract_answer  # noqa: F401

        self._score  # noqa: B018

    def extract(self, text: str) -> str | None:
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(text)
        if answer is not None:
            return answer
        if self.answer_format == "last_number":
            numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
            return numbers[-1] if numbers else None
        return _last_line(text)

    def __call__(self, prompt: Mapping, text: str) -> dict:
        score = float(self._score(self.extract(text), prompt["entry"]))
        return {"reward": score, "outcome": score >= 1.0}


def reasoning_gym_task(name: str, *, size: int = 2000, validation_size: int = 200,
                       test_size: int = 200, seed: int = 0, system_prompt: str = "default",
                       level_key: str = "", answer_format: str = "last_line",
                       **dataset_kwargs) -> Task:
    """A reasoning-gym dataset `name` (its options, e.g. `min_terms`, in `dataset_kwargs`):
    train, validation and test generated with seeds `seed`, `seed + SPLIT_SEED_STRIDE`,
    `seed + 2 * SPLIT_SEED_STRIDE` (reasoning-gym draws item i from seed + i, so nearby seeds
    would give the same items shifted); questions that appear in train are dropped from
    validation and test, so the splits are disjoint.
    Prompts are chat messages: a system turn (`system_prompt`, a key of reasoning-gym's
    SYSTEM_PROMPTS, or "" for none) and the question. `level_key` names the metadata field
    used as the prompt's level (e.g. "num_terms"), for per-level evaluation and curricula;
    `answer_format` where to find the answer without tags (`ReasoningGymReward`)."""
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt and system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"reasoning_gym:{name}: system_prompt {system_prompt!r} is not one of "
                         f"{sorted(SYSTEM_PROMPTS)} (or '' for none)")
    system = [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]}] if system_prompt \
        else []
    seen: set[str] = set()
    splits = {}
    for offset, (split, n) in enumerate((("train", size), ("validation", validation_size),
                                         ("test", test_size))):
        if n <= 0:
            splits[split] = []
            continue
        if n > SPLIT_SEED_STRIDE:
            raise ValueError(f"reasoning_gym:{name}: a split of {n} > {SPLIT_SEED_STRIDE} "
                             "prompts would overlap the next split's seeds")
        data = reasoning_gym.create_dataset(name, size=n, seed=seed + offset * SPLIT_SEED_STRIDE,
                                            **dataset_kwargs)
        out = []
        for i in range(n):
            entry = data[i]
            if split != "train" and entry["question"] in seen:
                continue
            if split == "train":
                seen.add(entry["question"])
            level = entry["metadata"].get(level_key, 0) if level_key else 0
            if not isinstance(level, int):
                raise ValueError(f"reasoning_gym:{name}: metadata {level_key!r} is "
                                 f"{level!r}, not an integer level")
            out.append({"prompt_id": f"{name}/{split}/{i}", "level": level,
                        "prompt": system + [{"role": "user", "content": entry["question"]}],
                        "answer": str(entry["answer"]), "entry": entry})
        splits[split] = out
    return Task(reward=ReasoningGymReward(name, answer_format), name=f"reasoning_gym:{name}",
                **splits)


def _read_prompt_file(path: str) -> list[tuple[str, dict]]:
    """(where, row) of every row: `path:line` of a JSONL line (blank lines skipped), `path: row
    n` of a Parquet row. A JSONL line that is not a JSON object is an error naming it."""
    if path.endswith(".parquet"):
        extras.require("parquet")
        import pyarrow.parquet as pq

        return [(f"{path}: row {n}", row)
                for n, row in enumerate(pq.read_table(path).to_pylist(), 1)]
    return [(f"{path}:{n}", row) for n, row in json_objects(path)]


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in prompt)


def _row_prompt(where: str, row: dict, prompt_key: str, template: str) -> str | list:
    """The prompt of one prompt-file row (see `prompt_files`); a template field the row lacks,
    a missing prompt field or a prompt of another type is an error naming `where`."""
    if template:
        try:
            return template.format(**row)
        except KeyError as e:
            raise ValueError(f"{where}: expected a field {e.args[0]!r} (task_args template "
                             f"{template!r}); the row has {sorted(row)}") from None
        except (IndexError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: task_args template {template!r} cannot be filled from "
                             f"the row's fields {sorted(row)}: {e}") from None
    if prompt_key not in row:
        raise ValueError(f"{where}: expected a {prompt_key!r} field (the row has "
                         f"{sorted(row)}); set task_args prompt_key or template")
    prompt = row[prompt_key]
    if not isinstance(prompt, str) and not _is_chat(prompt):
        raise ValueError(f"{where}: expected field {prompt_key!r} to be text or chat messages "
                         f'[{{"role": ..., "content": ...}}], got {prompt!r:.60}')
    return prompt


def import_spec(spec: str, what: str) -> Callable:
    """`package.module:function`, or `path/to/file.py:function` (its directory goes on
    sys.path, so the reward pool's processes and the rollout workers import it by name too)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must be 'package.module:function' or "
                         "'path/to/file.py:function'")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ValueError(f"{what} {spec!r}: no file {module_name}")
        directory = os.path.dirname(os.path.abspath(module_name))
        if directory not in sys.path:
            sys.path.insert(0, directory)
        module_name = os.path.basename(module_name)[:-3]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({e}); is it on "
                         "PYTHONPATH?") from e
    if not hasattr(module, attr):
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def prompt_files(*, train: str, test: str, validation: str = "", reward: str = "math",
                 prompt_key: str = "prompt", template: str = "") -> Task:
    """Prompts from JSONL (one JSON object per line) or Parquet files, one per split. Each row
    becomes a prompt dict: its `prompt_key` field is the prompt (text or chat messages; with
    `template`, `template.format(**row)` is), the other fields stay for the reward. `reward` is
    "math" (math-verify against `answer`), "exact" (last line equals `answer`), "arith", or a
    "package.module:function" of your own. Every row is checked as it is read: a line that is
    not a JSON object, a template field or prompt the row lacks is an error naming
    `path:line`."""
    fn = NAMED_REWARDS.get(reward) or import_spec(reward, "reward")
    files = (("train", train), ("validation", validation), ("test", test))
    for split, path in files:
        if path and not os.path.exists(path):
            raise FileNotFoundError(f"task files: no {split} file {path}")
    splits = {}
    for split, path in files:
        if not path:
            splits[split] = []
            continue
        out = []
        for i, (where, row) in enumerate(_read_prompt_file(path)):
            out.append({**row, "prompt": _row_prompt(where, row, prompt_key, template),
                        "prompt_id": str(row.get("prompt_id", f"{split}/{i}"))})
        splits[split] = out
    return Task(reward=fn, name=f"files:{os.path.basename(train)}", **splits)


# ---- what the loops and workers use ------------------------------------------------------------
def reward_fn(task: Task) -> tuple[Callable[[str, Any], Any], Callable[[Mapping], dict]]:
    """(pool reward function, target of a prompt) for the RL rollouts of `task`."""
    return PromptReward(task.reward), reward_target


def char_decode(ids) -> str:
    """Module-level (picklable) detokeniser for reward-pool processes."""
    return _CHAR.decode(ids, errors="replace")


def decoder(config, tokenizer):
    """The detokeniser of reward-pool processes: the module-level `char_decode` for the
    character tokenizer (picklable), else the tokenizer's own `decode`."""
    return char_decode if config.tokenizer == "char" else tokenizer.decode
