"""Baseline: GRPO (token-level clip 0.2, sequence-mean aggregation).

Identical to `arith_espo.py` except for the loss (the recipe is `arith_common.py`).

    python -m espo_jax.main --config experiments/arith_grpo.py --workdir /tmp/espo_arith_grpo

Measured from `arith_espo.py`'s seed-0 warm start (`--config.checkpoint.init_from`, as
`python launch/arith_compare.py --workdir /tmp/arith_compare --jobs 1` runs it): held-out greedy
accuracy 0.700 -> 0.810 (+11.0 points) after 120 RL steps (318 s of RL; ESPO +17.5),
2026-12-01 (main at d39660c), 2-core AMD EPYC CPU, run alone. See
experiments/results/arith_comparison.json.
"""

import os

from espo_jax import configs

arith = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "arith_common.py"))


def get_config(arg: str | None = None):
    return arith.arith_config(arg, loss_name="grpo")
