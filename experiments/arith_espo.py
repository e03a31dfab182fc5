"""The default experiment: ESPO with every zero-variance stage on synthetic arithmetic.

`small` MoE on `arith_chains`: a supervised warm start on worked solutions of the easy levels,
then ESPO on all levels with the FP8 embedded engine and router replay (R3). The recipe is
`arith_common.py`, shared with the GRPO, DAPO and GSPO baselines.

    python -m espo_jax.main --config experiments/arith_espo.py --workdir /tmp/espo_arith

Measured: held-out greedy accuracy 0.700 -> 0.810 on seed 0 after 120 RL steps; seeds 0-4
0.685 +- 0.027 -> 0.845 +- 0.066 (+16.0 +- 7.8 points); seed 0 at d1001f0, seeds 1-4 at
fa07b85, 2026-12-05, 2-core AMD EPYC CPU with AVX-512 (experiments/results/arith_espo_seeds.json).
See experiments/results/README.md for the seeds, the recipe on validation and the recipe log.

Laptop-size variant (tiny model, 2 RL steps), as the tests run it:

    python -m espo_jax.main --config experiments/arith_espo.py:small --workdir /tmp/espo_small
"""

import os

from espo_jax import configs

arith = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "arith_common.py"))


def get_config(arg: str | None = None):
    return arith.arith_config(arg, loss_name="espo")
