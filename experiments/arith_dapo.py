"""Baseline: DAPO (asymmetric token clip 0.2 / 0.28, token-mean aggregation).

Identical to `arith_espo.py` except for the loss.

    python -m espo_jax.main --config experiments/arith_dapo.py --workdir /tmp/espo_arith_dapo
"""

from espo_jax import configs


def get_config(arg: str | None = None):
    return configs.arith_config(arg, loss_name="dapo")
