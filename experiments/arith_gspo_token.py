"""Baseline: GSPO-token (GSPO's sequence-level ratio with per-token advantages through
sg[s] * pi / sg[pi]; clip 3e-4 / 4e-4).

Identical to `arith_espo.py` except for the loss (the recipe is `arith_common.py`). With one
advantage per response, as here, its gradient equals GSPO's; it differs only where a task gives
per-token advantages.

    python -m espo_jax.main --config experiments/arith_gspo_token.py --workdir /tmp/espo_gspo_tok

Measured over seeds 0-2 with `python launch/loss_seeds.py` (62a8942, 2026-12-03, 2-core AMD
EPYC without AVX-512; experiments/results/loss_seeds_chosen_lr.json): on-policy the same runs
as `arith_grpo.py` token for token (test accuracy 0.650 / 0.700 / 0.725 in both): with ratios of
exactly 1 its surrogate's gradient is GRPO's, as it must be. Its seeds beside the other four
losses: experiments/results/README.md ("The five losses over seeds").
"""

import os

from espo_jax import configs

arith = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "arith_common.py"))


def get_config(arg: str | None = None):
    return arith.arith_config(arg, loss_name="gspo_token")
