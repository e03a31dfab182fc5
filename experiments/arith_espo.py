"""The default experiment: ESPO with every zero-variance stage on synthetic arithmetic.

`small` MoE on `arith_chains`: a supervised warm start on worked solutions of the easy levels,
then ESPO on all levels with the FP8 embedded engine and router replay (R3).

    python -m espo_jax.main --config experiments/arith_espo.py --workdir /tmp/espo_arith

Laptop-size variant (tiny model, 2 RL steps), as the tests run it:

    python -m espo_jax.main --config experiments/arith_espo.py:small --workdir /tmp/espo_small
"""

from espo_jax import configs


def get_config(arg: str | None = None):
    return configs.arith_config(arg, loss_name="espo")
