"""The run's record, `WORKDIR/config.json`, and what a second start in the same WORKDIR may do.

The main job calls `start` for the learner of either layout (the single-process loop and the
worker layout's learner) once the config is valid and before any work: no model is built, no
data prepared, no checkpoint read.

`config.json` holds the resolved config (nested), the command line, the git commit of the code
that runs (null outside a git checkout), the start time (UTC) and the versions of jax, jaxlib,
flax, optax, orbax-checkpoint, numpy and espo_jax. A WORKDIR that holds one is a run; started
again, it

  - says it is finished and does nothing when summary.json shows its RL steps done (or its
    `train.max_tokens` spent): summary.json stays as it was, byte for byte;
  - resumes when its config is the stored one, or differs only in the run-length keys
    (`RUN_LENGTH_KEYS`: train.steps, train.max_tokens, eval.every, checkpoint.every,
    checkpoint.keep), the change logged;
  - is refused before any work when any other key differs, naming each with its old and new
    value, unless the main job is given `--allow_config_change`; the change is then logged.

Every start that runs appends the record it replaces to the new one's `history` (oldest first),
with what changed in `changes`. Rollout workers started on their own (`--config.mode=rollout`)
neither write nor check it: they may differ from the learner by design (the vLLM engine, its
tensor parallelism).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence

import ml_collections

from espo_jax import console, distributed

# How long a run goes and how often it evaluates or saves, not what a step does; but
# `train.steps` also sets the length of the lr schedule (`optim.final_lr_frac` < 1 decays
# over it): a resumed run with more steps goes on along the longer schedule from its step.
RUN_LENGTH_KEYS = ("train.steps", "train.max_tokens", "eval.every", "checkpoint.every",
                   "checkpoint.keep")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
RECORD = "config.json"
_ABSENT = "(absent)"


class ConfigChangedError(ValueError):
    """A WORKDIR's run started again with a config that differs beyond `RUN_LENGTH_KEYS`."""


def flat(tree: Mapping, prefix: str = "") -> dict:
    """{"a.b.c": value} of a nested dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def as_json(config: ml_collections.ConfigDict) -> dict:
    """The config as config.json stores it (tuples become lists), so that stored and new
    configs compare equal when they are."""
    return json.loads(config.to_json())


def differences(old: Mapping, new: Mapping) -> dict[str, tuple]:
    """{key: (old value, new value)} for every leaf that differs; `_ABSENT` on the side that
    lacks a key (a config written by other code)."""
    a, b = flat(old), flat(new)
    return {k: (a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in sorted(a.keys() | b.keys())
            if a.get(k, _ABSENT) != b.get(k, _ABSENT)}


def git_commit() -> str | None:
    """The commit of the checkout espo_jax runs from; None outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def versions() -> dict[str, str | None]:
    """Installed versions of `PACKAGES` (None if absent) and of the running espo_jax."""
    from importlib import metadata

    import espo_jax

    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["espo_jax"] = espo_jax.__version__
    return found


def command_line(argv: Sequence[str]) -> str:
    """The command as typed for the main job (`python -m espo_jax.main ...`)."""
    head = (["python", "-m", "espo_jax.main"] if argv and argv[0].endswith(
        os.path.join("espo_jax", "main.py")) else list(argv[:1]))
    return shlex.join(head + list(argv[1:]))


def new_record(config: ml_collections.ConfigDict, argv: Sequence[str]) -> dict:
    return {"config": as_json(config), "command": command_line(argv), "git_commit": git_commit(),
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": versions(), "changes": {}}


def read_record(workdir: str) -> dict | None:
    path = os.path.join(workdir, RECORD)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_record(workdir: str, record: dict) -> None:
    """Writes config.json whole or not at all (a temporary file renamed over it)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, RECORD)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


def finished_summary(config: ml_collections.ConfigDict, workdir: str) -> str | None:
    """summary.json's path when it shows the run done under `config`: `train.steps` RL steps,
    or with `train.max_tokens` > 0 that many generated tokens (`Run.finished`'s rule); else
    None (no summary, or one a longer config goes on from)."""
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        summary = json.load(f)
    budget = config.train.max_tokens
    if summary["steps"] >= config.train.steps or (
            budget > 0 and summary["generated_tokens"] >= budget):
        return path
    return None


def _show(value) -> str:
    return value if value == _ABSENT else json.dumps(value)


def refusal(workdir: str, changed: Mapping[str, tuple]) -> str:
    lines = [f"{workdir} holds a run started with another config ({os.path.join(workdir, RECORD)}"
             f"); {len(changed)} key(s) differ:"]
    lines += [f"  {k}: {_show(old)} -> {_show(new)}" for k, (old, new) in changed.items()]
    lines.append("Rerun with the stored config (only " + ", ".join(RUN_LENGTH_KEYS) + " may "
                 "change), use a new --workdir, or pass --allow_config_change to go on with the "
                 "new config on purpose.")
    return "\n".join(lines)


def banner(config: ml_collections.ConfigDict) -> str | None:
    """What a plumbing-check run (`config.plumbing_check`, the `:small` variants) is, for the
    console at start; None for other runs."""
    if not config.plumbing_check:
        return None
    model = (f"`{os.path.basename(config.model.hf_path.rstrip('/'))}`" if config.model.hf_path
             else f"`{config.model.preset}` (random weights)")
    warm = (f"{config.warmstart.steps} warm-start steps, then " if config.warmstart.steps
            else "")
    tiny = not config.model.hf_path and config.model.preset.startswith("tiny")
    return (f"plumbing check (`:small`), model {model}: {warm}{config.train.steps} RL steps of "
            f"{config.rollout.prompts_per_step} prompts x {config.zve.n_samples} samples, "
            f"{config.eval.num_prompts} held-out prompts.\n"
            f"  It checks that every stage runs end to end (data, {'warm start, ' if warm else ''}"
            "engine, rewards, buffer, learner, checkpoints, summary);\n  accuracy is not "
            "expected to move" + (" (0.000 and zero-variance fraction 1 at every step are "
                                  "expected)" if tiny else "")
            + ". Drop `:small` for the experiment itself.")


def start(config: ml_collections.ConfigDict, workdir: str, argv: Sequence[str],
          allow_change: bool = False) -> str | None:
    """The checks and record of a learner's start (module docstring). Returns summary.json's
    path when the run is finished (nothing written; the caller stops), else None once
    config.json is written. Raises `ConfigChangedError` for a refused change."""
    old = read_record(workdir)
    record = new_record(config, argv)
    changed = differences(old["config"], record["config"]) if old else {}
    refused = {k: v for k, v in changed.items() if k not in RUN_LENGTH_KEYS}
    if refused and not allow_change:
        raise ConfigChangedError(refusal(workdir, refused))
    done = finished_summary(config, workdir)
    if done:
        return done
    if old is None and os.path.isdir(os.path.join(workdir, "checkpoints")):
        logging.warning("%s holds checkpoints but no %s (written before runs kept one): its "
                        "config cannot be checked; recording this one", workdir, RECORD)
    if changed:
        logging.warning("%s: the config differs from the stored one (%s) in %s", workdir,
                        "allowed by --allow_config_change" if refused else "run-length keys",
                        "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in
                                  changed.items()))
    record["changes"] = {k: {"old": a, "new": b} for k, (a, b) in changed.items()}
    if old:
        record["history"] = old.pop("history", []) + [old]
    if distributed.is_primary():
        write_record(workdir, record)
    logging.info("run record: %s (commit %s)", os.path.join(workdir, RECORD),
                 record["git_commit"], extra=console.FILE_ONLY)
    text = banner(config)
    if text:
        print(text, flush=True)
        logging.info("%s", text, extra=console.FILE_ONLY)
    return None


def finished_line(workdir: str, summary_path: str) -> str:
    with open(summary_path) as f:
        steps = json.load(f)["steps"]
    return f"{workdir}: finished ({steps} RL steps done), nothing to run; summary: {summary_path}"
