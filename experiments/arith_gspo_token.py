"""Baseline: GSPO-token (GSPO's sequence-level ratio with per-token advantages through
sg[s] * pi / sg[pi]; clip 3e-4 / 4e-4).

Identical to `arith_espo.py` except for the loss (the recipe is `arith_common.py`). With one
advantage per response, as here, its gradient equals GSPO's; it differs only where a task gives
per-token advantages.

    python -m espo_jax.main --config experiments/arith_gspo_token.py --workdir /tmp/espo_gspo_tok

Measured with `python launch/loss_seeds.py --workdir DIR --jobs 2` (2026-12-02, 2-core AMD
EPYC; from the seed-0 warm start, 260k generated tokens, one update per rollout batch): the
same run as `arith_grpo.py` token for token (264668 generated tokens, test accuracy 0.705 in
both): with ratios of exactly 1 its surrogate's gradient is GRPO's, as it must be. Its seeds
beside the other four losses: experiments/results/README.md ("The five losses over seeds").
"""

import os

from espo_jax import configs

arith = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "arith_common.py"))


def get_config(arg: str | None = None):
    return arith.arith_config(arg, loss_name="gspo_token")
