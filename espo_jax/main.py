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
flags.mark_flags_as_required(["config", "workdir"])


def main(argv) -> int:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import jax

    jax.config.update("jax_compilation_cache_dir",
                      os.path.expanduser("~/.cache/espo_jax/jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from espo_jax import configs

    config, workdir = _CONFIG.value, _WORKDIR.value
    configs.validate(config, n_devices=jax.device_count())
    logging.getLogger().setLevel(logging.INFO)
    os.makedirs(workdir, exist_ok=True)
    if config.mode == "rollout":
        from espo_jax.rollout import worker

        return worker.main_from_config(config, workdir)
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
