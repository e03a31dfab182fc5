"""A loss of your own, registered on import: REINFORCE with importance weights.

    J_t = r_t A_t,   r_t = pi(y_t) / pi_old(y_t)   (no clip; token mean over the batch)

On-policy (one update per rollout batch) r_t = 1 and its gradient is A_t d log pi(y_t), plain
REINFORCE with the run's group advantages. Any experiment trains with it from the command line:

    python -m espo_jax.main --config experiments/arith_espo.py --workdir /tmp/reinforce \\
        --config.imports=my_loss --config.loss.name=reinforce

`--config.imports` finds this file in `experiments/` (or the working directory, or on
`sys.path`; espo_jax/config_imports.py); the main job and every rollout worker import it
before the config is validated. tests/test_config_imports.py runs the command above (`:small`).
"""

import jax.numpy as jnp

from espo_jax.rl import losses


@losses.register("reinforce", aggregation="token_mean")
def reinforce(logp, old_logp, advantages, mask, config, *, entropy=None) -> losses.Surrogate:
    """J_t = r_t A_t, unclipped: the bounds are 0 and inf, so no token counts as clipped."""
    del config, entropy
    ratio = jnp.exp(jnp.where(mask > 0, logp - old_logp, 0.0))
    return losses.Surrogate(objective=ratio * advantages * mask, ratio=ratio,
                            lower=jnp.zeros_like(ratio), upper=jnp.full_like(ratio, jnp.inf),
                            group_weights=None, metrics={})
