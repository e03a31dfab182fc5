"""Baseline: GRPO (token-level clip 0.2, sequence-mean aggregation).

Identical to `arith_espo.py` except for the loss (the recipe is `arith_common.py`).

    python -m espo_jax.main --config experiments/arith_grpo.py --workdir /tmp/espo_arith_grpo

Measured over seeds 0-2 from the default's warm starts until `train.max_tokens=260000`, with
`python launch/loss_seeds.py` (62a8942, 2026-12-03, 2-core AMD EPYC without AVX-512;
experiments/results/loss_seeds_chosen_lr.json): test accuracy 0.692 on-policy (+1.2 +- 7.1 points
over the warm starts), 0.708 off-policy with 4 updates per batch at lr 1e-4 (+2.8 +- 3.1 points).
These runs rank none of the five losses: experiments/results/README.md ("The five losses").
"""

import os

from espo_jax import configs

arith = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "arith_common.py"))


def get_config(arg: str | None = None):
    return arith.arith_config(arg, loss_name="grpo")
