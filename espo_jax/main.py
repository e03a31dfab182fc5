"""The main job: `python -m espo_jax.main --config experiments/<name>.py --workdir DIR`.

`--config.x.y=v` overrides a field. Modes: `--config.mode=train` (default: the learner; with
`train.loop=sync` the embedded engine runs in the same process) and `--config.mode=rollout` (a
rollout worker process for the async layout; see `espo_jax.rollout.worker`).
"""

import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config file", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics and buffer")
# Multi-host (espo_jax/distributed.py): else ESPO_COORDINATOR / ESPO_NUM_PROCESSES /
# ESPO_PROCESS_ID, else Slurm or ESPO_DISTRIBUTED=auto (TPU), else one process.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "JAX processes (hosts)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv) -> int:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import jax

    jax.config.update("jax_compilation_cache_dir",
                      os.path.expanduser("~/.cache/espo_jax/jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from espo_jax import configs, distributed

    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    config, workdir = _CONFIG.value, _WORKDIR.value
    configs.validate(config, n_devices=jax.device_count())
    if jax.process_count() > 1 and (config.mode, config.train.loop) != ("train", "async"):
        raise ValueError(f"{jax.process_count()} JAX processes: only the learner of "
                         "train.loop=async runs multi-host (rollout workers are single processes)")
    logging.getLogger().setLevel(logging.INFO)
    os.makedirs(workdir, exist_ok=True)
    if config.mode == "rollout":
        from espo_jax.rollout import worker

        return worker.main_from_config(
            config, workdir, index=int(os.environ.get("ESPO_WORKER_INDEX", "0")),
            num_workers=int(os.environ.get("ESPO_NUM_WORKERS", "1")))
    if config.train.loop == "async":
        from espo_jax.train import async_loop

        summary = async_loop.run_async(config, workdir)
    else:
        from espo_jax.train import loop

        summary = loop.run_sync(config, workdir)
    print({k: v for k, v in summary.items() if not isinstance(v, dict)})
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
