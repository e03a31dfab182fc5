"""Checkpoints with orbax `CheckpointManager`: everything needed to resume exactly.

A checkpoint holds the train state arrays (params, optimiser state, step, skip counter, RNG)
and a JSON item `meta` with the host-side state: the buffer reader cursor, the prompt
scheduler's state, the policy version, the run phase and anything else the loop records.
Resume order (`start_point`, `run.Run._start`): WORKDIR's latest checkpoint, then its
warm-started policy, then `config.checkpoint.init_from`, then from scratch. Before any work the
checkpoint a run will start from is found and its parameter shapes compared with the config's
model (`check_params`), so a path that holds no checkpoint, or one of another architecture, is
an error naming the path or the first differing parameter instead of an orbax failure later.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from espo_jax.train.state import TrainState


def _arrays(state: TrainState) -> dict[str, Any]:
    return {
        "params": state.params,
        "opt_state": state.opt_state,
        "step": state.step,
        "skipped": state.skipped,
        "rng": state.rng,
    }


def checkpoint_steps(directory: str) -> list[int]:
    """The steps saved under `directory` (none when it does not exist; nothing is created)."""
    return sorted(ocp.utils.checkpoint_steps(directory)) if os.path.isdir(directory) else []


def resolve_init_from(path: str) -> str:
    """The checkpoint directory `config.checkpoint.init_from` names: `path` itself when it holds
    checkpoints; given a run's WORKDIR instead, its `warmstart/` or `checkpoints/` when only one
    of them does (logged). Anything else is an error naming the paths to give."""
    if checkpoint_steps(path):
        return path
    found = {name: checkpoint_steps(os.path.join(path, name))
             for name in ("warmstart", "checkpoints")}
    found = {name: steps[-1] for name, steps in found.items() if steps}
    if len(found) == 1:
        (name, step), = found.items()
        logging.info("checkpoint.init_from=%s is a run's WORKDIR: starting from its %s/ "
                     "(step %d)", path, name, step)
        return os.path.join(path, name)
    if found:
        raise ValueError(
            f"config.checkpoint.init_from={path!r} is a run's WORKDIR, not a checkpoint "
            f"directory: give {os.path.join(path, 'warmstart')} (its warm-started policy) or "
            f"{os.path.join(path, 'checkpoints')} (its latest RL checkpoint, step "
            f"{found['checkpoints']})")
    raise ValueError(f"config.checkpoint.init_from={path!r} holds no checkpoint, nor does a "
                     "warmstart/ or checkpoints/ under it (a run's WORKDIR)")


def start_point(workdir: str, init_from: str) -> tuple[str, int] | None:
    """(directory, step) of the checkpoint a run in `workdir` starts from, in the resume order
    of the module doc; None: from scratch."""
    for name in ("checkpoints", "warmstart"):
        steps = checkpoint_steps(os.path.join(workdir, name))
        if steps:
            return os.path.join(workdir, name), steps[-1]
    if init_from:
        directory = resolve_init_from(init_from)
        return directory, checkpoint_steps(directory)[-1]
    return None


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
            for path, leaf in flat}


def check_params(directory: str, step: int, params: Any) -> None:
    """Raises ValueError unless the parameters saved at `step` under `directory` have the
    names and shapes of `params` (arrays or `jax.ShapeDtypeStruct`s: the config's model),
    naming the first that differs; reads the checkpoint's metadata only."""
    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(directory) / str(step) / "state")
    saved = _shapes((meta.tree if hasattr(meta, "tree") else meta)["params"])
    want = _shapes(params)
    where = f"checkpoint {os.path.join(directory, str(step))} does not fit the config's model"
    for name, shape in want.items():
        if name not in saved:
            raise ValueError(f"{where}: it has no parameter {name} (shape {shape} in the "
                             f"config; it has {len(saved)} parameters, the config {len(want)})")
        if saved[name] != shape:
            raise ValueError(f"{where}: parameter {name} has shape {saved[name]} in the "
                             f"checkpoint, {shape} in the config")
    extra = [name for name in saved if name not in want]
    if extra:
        raise ValueError(f"{where}: it has parameters the config's model lacks, first {extra[0]} "
                         f"(shape {saved[extra[0]]})")


class Checkpointer:
    """Async orbax checkpoints under `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str, keep: int = 2, async_save: bool = True):
        self.directory = epath.Path(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True
            ),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_arrays(state)), meta=ocp.args.JsonSave(meta)
            ),
        )

    def restore(self, state: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """Restores into the structure (and shardings) of `state`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        check_params(str(self.directory), step, state.params)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _arrays(state))
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        arrays = restored["state"]
        logging.info("restored checkpoint step %d from %s", step, self.directory)
        return (
            state.replace(
                params=arrays["params"],
                opt_state=arrays["opt_state"],
                step=arrays["step"],
                skipped=arrays["skipped"],
                rng=arrays["rng"],
            ),
            dict(restored["meta"]),
        )

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
