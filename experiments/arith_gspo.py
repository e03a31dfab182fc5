"""Baseline: GSPO (one sequence-level ratio per response, clip 3e-4 / 4e-4).

Identical to `arith_espo.py` except for the loss.

    python -m espo_jax.main --config experiments/arith_gspo.py --workdir /tmp/espo_arith_gspo
"""

from espo_jax import configs


def get_config(arg: str | None = None):
    return configs.arith_config(arg, loss_name="gspo")
