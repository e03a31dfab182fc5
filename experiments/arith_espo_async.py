"""The default experiment in the worker layout: a learner and 2 JAX engine rollout workers.

The recipe of `arith_espo.py` (ESPO, every MS-ZVE stage, the same seed, warm start and 120 RL
steps), with `train.loop=async`: the learner process spawns two rollout worker processes that
meet it at WORKDIR/buffer and WORKDIR/weights (`espo_jax/train/async_loop.py`). Each worker runs
MS-ZVE stages 0, 1 and 5 on its half of the prompts and samples 16 of the step's 32 prompts
per batch; a batch may be one policy version old when the learner reads it (staleness 1).

    python -m espo_jax.main --config experiments/arith_espo_async.py --workdir /tmp/espo_async

Laptop-size variant (tiny model, 2 RL steps):

    python -m espo_jax.main --config experiments/arith_espo_async.py:small --workdir /tmp/espo_s

Measured beside the sync default: experiments/results/README.md ("The worker layout").
"""

import os

from espo_jax import configs

arith = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "arith_common.py"))


def get_config(arg: str | None = None):
    c = arith.arith_config(arg, loss_name="espo")
    c.train.loop = "async"
    c.train.num_workers = 2
    c.train.max_staleness = 1  # a batch is sampled while the learner trains on the previous one
    c.rollout.max_inflight_batches = 1
    # Two workers and the learner share the machine: each worker's reward pool gets one process.
    c.rollout.reward_workers = 1
    return c
