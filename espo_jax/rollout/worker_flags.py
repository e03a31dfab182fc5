"""The command-line flags of a rollout worker, the same for both engines.

    python -m espo_jax.rollout.worker   --config experiments/X.py --workdir W [--worker_index=I]
    python -m espo_jax.rollout.vllm_cli --config experiments/X.py --workdir W [--worker_index=I]
    python -m espo_jax.main --config experiments/X.py --workdir W --config.mode=rollout [...]

`--config.x.y=v` overrides a field. Worker I of N (`--worker_index`, `--num_workers`, by default
$ESPO_WORKER_INDEX / $ESPO_NUM_WORKERS, else 0 of 1) takes every N-th training prompt from the
I-th. `--max_batches`, `--until_version` and `--stats` bound a run and report it (tests, jobs).

absl flags are global: importing this module defines them, so only entry points import it
(`espo_jax.main`, and the workers' `if __name__ == "__main__":` blocks).
"""

import os

from absl import flags
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file(
    "config", None, "experiment config file (experiments/<name>.py[:arg])", lock_config=True)
WORKDIR = flags.DEFINE_string(
    "workdir", None, "the run's directory: checkpoints, metrics, weights/ (the published "
    "policy), buffer/ (rollout groups), data/")
WORKER_INDEX = flags.DEFINE_integer(
    "worker_index", int(os.environ.get("ESPO_WORKER_INDEX", "0")),
    "rollout worker: this worker's index among --num_workers (default $ESPO_WORKER_INDEX or 0)")
NUM_WORKERS = flags.DEFINE_integer(
    "num_workers", int(os.environ.get("ESPO_NUM_WORKERS", "1")),
    "rollout worker: workers sharing the training prompts (default $ESPO_NUM_WORKERS or 1)",
    lower_bound=1)
MAX_BATCHES = flags.DEFINE_integer(
    "max_batches", None, "rollout worker: stop after this many batches (default: until stopped)",
    lower_bound=0)
UNTIL_VERSION = flags.DEFINE_integer(
    "until_version", None, "rollout worker: stop after a batch sampled at this policy version "
    "or a newer one")
STATS = flags.DEFINE_string("stats", None, "rollout worker: write the run's totals (JSON) here")
flags.mark_flags_as_required(["config", "workdir"])
flags.register_multi_flags_validator(
    ["worker_index", "num_workers"], lambda f: 0 <= f["worker_index"] < f["num_workers"],
    "--worker_index must be in [0, --num_workers)")


def worker_args() -> dict:
    """The rollout flags as keyword arguments of the workers' `main_from_config`."""
    return {"index": WORKER_INDEX.value, "num_workers": NUM_WORKERS.value,
            "max_batches": MAX_BATCHES.value, "until_version": UNTIL_VERSION.value,
            "stats": STATS.value}
