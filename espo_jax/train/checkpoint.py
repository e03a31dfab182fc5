"""Checkpoints with orbax `CheckpointManager`: everything needed to resume exactly.

A checkpoint holds the train state arrays (params, optimiser state, step, skip counter, RNG)
and a JSON item `meta` with the host-side state: the buffer reader cursor, the prompt
scheduler's state, the policy version, the run phase and anything else the loop records.
Resume order (see `restore_or_init` in the main job): WORKDIR's latest checkpoint, then
`config.checkpoint.init_from`, then from scratch.
"""

from __future__ import annotations

import logging
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
