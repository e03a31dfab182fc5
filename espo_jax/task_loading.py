"""Resolving `config.task` to a `Task` (`espo_jax.tasks`):

    ""  or "arith_chains" / "math_jsonl"   the built-in TFDS tasks (`config.data.*`; "" follows
                                           `config.data.name`)
    "reasoning_gym:NAME"                   a reasoning-gym dataset, with its generator and scorer
    "files"                                JSONL / Parquet prompt files with a chosen reward
    "package.module:function"              your own: `function(**task_args)` returns a `Task`
    "path/to/file.py:function"             the same, from a file (experiments/my_task.py)

`config.task_args` is a JSON object of keyword arguments for the task function (see
`tasks.reasoning_gym_task` and `tasks.prompt_files` for theirs).
"""

from __future__ import annotations

import dataclasses
import json

from espo_jax.tasks import (
    Task,
    arith_chains_task,
    import_spec,
    math_jsonl_task,
    prompt_files,
    reasoning_gym_task,
)


def task_args(config) -> dict:
    """`config.task_args` parsed: a JSON object (an error names the key otherwise)."""
    raw = config.task_args or "{}"
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"config.task_args must be a JSON object, got {raw!r}: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"config.task_args must be a JSON object, got {raw!r}")
    return args


def task_name(config) -> str:
    return config.task or config.data.name


BUILTIN = {"arith_chains": arith_chains_task, "math_jsonl": math_jsonl_task}


def load_task(config, workdir: str, tokenizer) -> Task:
    """The `Task` named by `config.task` (module doc), its prompts not yet tokenised."""
    spec, args = task_name(config), task_args(config)
    if spec in BUILTIN:
        if args:
            raise ValueError(f"config.task_args {args} given for the built-in task {spec!r}, "
                             "which reads config.data.* instead")
        return BUILTIN[spec](config, workdir, tokenizer)
    if spec.startswith("reasoning_gym:"):
        task = reasoning_gym_task(spec.partition(":")[2], **{"seed": config.seed, **args})
    elif spec == "files":
        task = prompt_files(**args)
    else:
        task = import_spec(spec, "config.task")(**args)
    if not isinstance(task, Task):
        raise TypeError(f"config.task {spec!r} returned {type(task).__name__}, not a "
                        "espo_jax.tasks.Task")
    return dataclasses.replace(task, name=task.name or spec)

