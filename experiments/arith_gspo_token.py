"""Baseline: GSPO-token (GSPO's sequence-level ratio with per-token advantages through
sg[s] * pi / sg[pi]; clip 3e-4 / 4e-4).

Identical to `arith_espo.py` except for the loss (the recipe is `arith_common.py`). With one
advantage per response, as here, its gradient equals GSPO's; it differs only where a task gives
per-token advantages.

    python -m espo_jax.main --config experiments/arith_gspo_token.py --workdir /tmp/espo_gspo_tok

Its seeds beside the other four losses: `python launch/loss_seeds.py` (experiments/results/
README.md, "The five losses over seeds").
"""

import os

from espo_jax import configs

arith = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "arith_common.py"))


def get_config(arg: str | None = None):
    return arith.arith_config(arg, loss_name="gspo_token")
