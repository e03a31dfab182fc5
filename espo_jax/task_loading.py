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
import inspect
import json

from espo_jax.choices import BUILTIN_DATA
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


def check_task_args(fn, args: dict, spec: str, *, given: tuple[str, ...] = (),
                    extra: tuple[str, ...] = ()) -> None:
    """`config.task_args` against the task function's signature, before it runs: an unknown
    key, or a required parameter left out, is an error naming the key, the task and the
    parameters it accepts. `given`: parameters passed besides `task_args` (not the user's to
    set); `extra`: keys a `**kwargs` parameter accepts (without it any key is accepted)."""
    params = inspect.signature(fn).parameters.values()
    named = [p.name for p in params if p.name not in given and p.kind in (
        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    accepted = named + [k for k in extra if k not in named and k not in given]
    any_key = any(p.kind == p.VAR_KEYWORD for p in params) and not extra
    where = f"task {spec!r} ({fn.__module__}.{fn.__qualname__})"
    unknown = [k for k in args if k not in accepted]
    if unknown and not any_key:
        raise ValueError(f"config.task_args key(s) {unknown} are not parameters of {where}; it "
                         f"accepts: {', '.join(accepted) or 'none'}")
    missing = [p.name for p in params if p.name not in given and p.name not in args
               and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ValueError(f"config.task_args lacks {missing}, required by {where}")


def reasoning_gym_options(name: str) -> tuple[str, ...]:
    """The options of reasoning-gym dataset `name` (its config dataclass's fields)."""
    from reasoning_gym.factory import DATASETS

    return tuple(f.name for f in dataclasses.fields(DATASETS[name][1]))


def check_builtin_task_args(config) -> None:
    """`check_task_args` for the tasks that need no import of the user's code: reasoning-gym
    (its function's keys and the dataset's options) and prompt files."""
    spec, args = task_name(config), task_args(config)
    if spec.startswith("reasoning_gym:"):
        check_task_args(reasoning_gym_task, args, spec, given=("name",),
                        extra=reasoning_gym_options(spec.partition(":")[2]))
    elif spec == "files":
        check_task_args(prompt_files, args, spec)


def task_name(config) -> str:
    return config.task or config.data.name


BUILTIN = dict(zip(BUILTIN_DATA, (arith_chains_task, math_jsonl_task), strict=True))


def load_task(config, workdir: str, tokenizer) -> Task:
    """The `Task` named by `config.task` (module doc), its prompts not yet tokenised."""
    spec, args = task_name(config), task_args(config)
    if spec in BUILTIN:
        if args:
            raise ValueError(f"config.task_args {args} given for the built-in task {spec!r}, "
                             "which reads config.data.* instead")
        return BUILTIN[spec](config, workdir, tokenizer)
    if spec.startswith("reasoning_gym:") or spec == "files":
        check_builtin_task_args(config)
    if spec.startswith("reasoning_gym:"):
        task = reasoning_gym_task(spec.partition(":")[2], **{"seed": config.seed, **args})
    elif spec == "files":
        task = prompt_files(**args)
    else:
        fn = import_spec(spec, "config.task")
        check_task_args(fn, args, spec)
        task = fn(**args)
    if not isinstance(task, Task):
        raise TypeError(f"config.task {spec!r} returned {type(task).__name__}, not a "
                        "espo_jax.tasks.Task")
    return dataclasses.replace(task, name=task.name or spec)

