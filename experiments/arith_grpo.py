"""Baseline: GRPO (token-level clip 0.2, sequence-mean aggregation).

Identical to `arith_espo.py` except for the loss.

    python -m espo_jax.main --config experiments/arith_grpo.py --workdir /tmp/espo_arith_grpo
"""

from espo_jax import configs


def get_config(arg: str | None = None):
    return configs.arith_config(arg, loss_name="grpo")
