"""espo_jax.zve: multi-stage zero-variance elimination (MS-ZVE).

A prompt group whose rewards are all equal gives group-relative advantages nothing to learn
from. Each stage avoids, repairs or drops such groups; each is one switch `zve.<stage>.enabled`
in `default_zve_config()` (all off: plain GRPO sampling).

  #  stage          config key         module              decides
  0  offline        zve.offline        offline.py          which prompts the starting policy
                                                           always (never) solves: pruned
  1  adaptive       zve.adaptive       adaptive.py         samples per prompt from its pass-
                                                           rate history; settled ones skipped
  2  tie-break      zve.tie_break      tie_break.py        each group's rewards: outcome, or a
                                                           length (step credit) tie-break
  3  RL-ZVP         zve.zvp            zvp.py              advantages of zero-variance groups
                                                           (applied by the learner)
  4  online filter  zve.online_filter  online_filter.py    which generated groups are trained
                                                           on; refills, bounded
  5  retirement     zve.retire         retire.py           which prompts retire after equal
                                                           streaks, and when they are re-probed

Around the stages:
  config.py     `default_zve_config`, `validate_zve_config`: every setting, one line each
  scheduler.py  `PromptScheduler`: each prompt's history and the epochs drawn from it
                (stages 0, 1, 5 decide from it); `status.py`: its prompt states
  groups.py     `ScoredGroup` (a `RolloutGroup` and its rewards), `binary_outcomes`,
                `require_scored` (`UnscoredGroupError`), `failed_reward_fraction`,
                `reward_failed`, `known_outcomes`
  metrics.py    `step_metrics`: the per-step `zve/...` scalars; `length_metrics`: the
                `lengths/...` ones (generated against trained)
  accounting.py no-signal tokens (no gradient): each figure's name and definition
  pipeline.py   `ZVEPipeline`: all of it around a caller's `rollout(plan)` callback

MS-ZVE reads `espo_jax.buffer.RolloutGroup`s and never writes to them; rewards travel beside
each group (`ScoredGroup`) into `Learner.update(state, groups, rewards)`. Stage decisions use
binary outcomes only, and of those the known ones: a response whose reward call failed or
timed out is missing, not wrong, in the pass-rate history (stages 0, 1, 5) and the
zero-variance predicate (stage 4, metrics); `zve.groups` says what a group with no known
outcome is. The zero-variance predicate and RL-ZVP's signs are defined once, in
`espo_jax.rl.advantages` (`zero_variance`, `zvp_signs`; re-exported by `zvp.py`).

Importing this package does not import JAX (rollout workers read the config); `zvp.py`, and
the first filter, metrics or stage-2 call, do. `rl_zvp`, `zero_variance`, `zvp_signs` are
loaded from `zvp.py` on first access.
"""

from espo_jax.zve.adaptive import adaptive_samples, zero_variance_prob
from espo_jax.zve.config import default_zve_config, validate_zve_config
from espo_jax.zve.groups import (
    ScoredGroup,
    UnscoredGroupError,
    binary_outcomes,
    failed_reward_fraction,
    groups_and_rewards,
    known_outcomes,
    require_scored,
    reward_failed,
)
from espo_jax.zve.metrics import length_metrics, step_metrics
from espo_jax.zve.offline import offline_pass, offline_undecided
from espo_jax.zve.online_filter import CollectResult, OnlineFilter, filter_groups
from espo_jax.zve.pipeline import Rollout, ZVEPipeline
from espo_jax.zve.scheduler import PromptScheduler
from espo_jax.zve.status import ACTIVE, PRUNED, RETIRED
from espo_jax.zve.tie_break import group_rewards, score_groups

_FROM_ZVP = ("rl_zvp", "zero_variance", "zvp_signs")


def __getattr__(name: str):
    if name in _FROM_ZVP:  # imports JAX: only when asked for
        from espo_jax.zve import zvp

        return getattr(zvp, name)
    raise AttributeError(f"module 'espo_jax.zve' has no attribute {name!r}")


__all__ = [
    "ACTIVE",
    "PRUNED",
    "RETIRED",
    "CollectResult",
    "OnlineFilter",
    "PromptScheduler",
    "Rollout",
    "ScoredGroup",
    "UnscoredGroupError",
    "ZVEPipeline",
    "adaptive_samples",
    "binary_outcomes",
    "default_zve_config",
    "failed_reward_fraction",
    "filter_groups",
    "group_rewards",
    "groups_and_rewards",
    "known_outcomes",
    "length_metrics",
    "offline_pass",
    "offline_undecided",
    "require_scored",
    "reward_failed",
    "rl_zvp",
    "score_groups",
    "step_metrics",
    "validate_zve_config",
    "zero_variance",
    "zero_variance_prob",
    "zvp_signs",
]
