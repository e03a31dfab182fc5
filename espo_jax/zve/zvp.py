"""MS-ZVE stage 3 (`zve.zvp`): RL-ZVP advantages for zero-variance groups (arXiv 2509.21880).

A group is zero-variance when its rewards are all equal (no contrast for group-relative
advantages) AND its binary outcomes are all equal. Instead of a zero advantage, RL-ZVP gives
its tokens an entropy-guided one, with H the old policy's token entropy:

    all correct:  A_t = +alpha * sg(H_t)
    all wrong:    A_t = -alpha * (max_t' H_t' - sg(H_t))    (only with `zvp.wrong_groups`)

The stage acts in the learner (`train.advantages.group_advantages` gives each response its
group's `zvp_signs`; `train.step.token_advantages` applies `zvp_token_advantages` with
`zvp.alpha`). With it on, a zero-variance group carries signal, so stage 4 keeps it
(`OnlineFilter.for_zve`) and the metrics count it as trained with signal.

The definitions live in `espo_jax.rl.advantages` (`rl/` imports nothing outside itself) and
are re-exported here: `zero_variance` (the one zero-variance predicate), `zvp_signs` (the one
sign rule), `rl_zvp` (the `[N, G, T]` reference formula) and `zvp_token_advantages`. Importing
this module imports JAX.
"""

from espo_jax.rl.advantages import rl_zvp, zero_variance, zvp_signs, zvp_token_advantages

__all__ = ["rl_zvp", "zero_variance", "zvp_signs", "zvp_token_advantages"]
