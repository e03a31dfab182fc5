"""MS-ZVE stage 2 (`zve.tie_break`): each group's rewards, tie-broken inside the correct tier.

With the stage off a group's rewards are its binary outcomes. With it on they are
`espo_jax.rewards.shaping.tie_break_rewards` of the outcomes and response lengths: a bounded
length term ranks the right responses of a group (shorter first by default) without ever
lifting a wrong one over a right one, so an all-right group gets reward contrast. With
`wrong_score="step_credit"` the wrong responses are ranked too, by the reward function's
`step_credit` component (`RolloutGroup.step_credits`; 0 where a response has none).

The group is read, never written: the rewards travel beside it (`ScoredGroup`). Outcomes stay
what filtering and the stages decide from.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import ml_collections
import numpy as np

from espo_jax.zve.groups import ScoredGroup, binary_outcomes

if TYPE_CHECKING:
    from espo_jax.buffer.records import RolloutGroup


def group_rewards(group: RolloutGroup, tie_break: ml_collections.ConfigDict,
                  max_len: int) -> np.ndarray:
    """float32 rewards of one group: its binary outcomes, or with stage 2 (`tie_break`, the
    `zve.tie_break` config) on, the tie-broken rewards inside the correct tier (and with
    `tie_break.wrong_score="step_credit"`, the group's step credits inside the wrong tier)."""
    outcomes = binary_outcomes(group.outcomes, str(group.prompt_id))
    if not tie_break.enabled:
        return outcomes.astype(np.float32)
    from espo_jax.rewards.shaping import tie_break_rewards  # imports JAX

    wrong = group.step_credits if tie_break.wrong_score == "step_credit" else None
    return tie_break_rewards(outcomes, group.response_lengths, max_len=max_len,
                             prefer=tie_break.prefer, tier_gap=tie_break.tier_gap,
                             band=tie_break.band, wrong_score=wrong)


def score_groups(groups: Iterable[RolloutGroup], tie_break: ml_collections.ConfigDict,
                 max_len: int) -> list[ScoredGroup]:
    """Each group with its `group_rewards`, in order."""
    return [ScoredGroup(g, group_rewards(g, tie_break, max_len)) for g in groups]
