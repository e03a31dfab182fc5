"""The default experiment: ESPO with every zero-variance stage on synthetic arithmetic.

`small` MoE on `arith_chains`: a supervised warm start on worked solutions of the easy levels,
then ESPO on all levels with the FP8 embedded engine and router replay (R3). The recipe is
`arith_common.py`, shared with the GRPO, DAPO and GSPO baselines.

    python -m espo_jax.main --config experiments/arith_espo.py --workdir /tmp/espo_arith

Measured: held-out greedy accuracy 0.700 -> 0.875 (+17.5 points) on seed 0 in 529 s (warm
start + 120 RL steps), 2026-12-01 (README at 035ebc6), 2-core AMD EPYC CPU, run alone, cold
compilation cache. See experiments/results/ (`arith_espo_summary.json`,
`accuracy_by_level.png`; other seeds and the recipe log in its README).

Laptop-size variant (tiny model, 2 RL steps), as the tests run it:

    python -m espo_jax.main --config experiments/arith_espo.py:small --workdir /tmp/espo_small
"""

import os

from espo_jax import configs

arith = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "arith_common.py"))


def get_config(arg: str | None = None):
    return arith.arith_config(arg, loss_name="espo")
