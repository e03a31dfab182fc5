"""What MS-ZVE passes along: buffer `RolloutGroup`s in, (group, rewards) pairs out.

MS-ZVE reads the groups a rollout produced (`espo_jax.buffer.RolloutGroup`: binary outcomes,
response lengths, step credits) and never writes to them. Stage 2 computes each group's
rewards once (`tie_break.score_groups`); from there on a group travels as a `ScoredGroup`, the
group and its float32 rewards side by side, through the online filter (stage 4), the metrics
and into the learner (`Learner.update(state, groups, rewards)`, see `groups_and_rewards`).

Stage decisions read binary outcomes only (`binary_outcomes` checks them), never a shaped
reward. The learner trains on scored groups only (`require_scored`, `UnscoredGroupError`).

A reward call that failed or timed out (`espo_jax.rewards.pool`: outcome False, reward
`failed_reward`) leaves the response's outcome *missing*, not wrong: the rollout side lists
such responses in `meta["reward_failed"]` (their indices, `rollout.generate`), `reward_failed`
reads that as a mask, and `known_outcomes` gives the outcomes MS-ZVE decides from: the pass-rate
history of stages 0, 1 and 5 and the zero-variance predicate of stage 4 and the metrics count
the known outcomes only. A group is zero-variance when its known outcomes all agree
([right, right, timeout] is all right); a group with no known outcome gives no evidence: it
changes no history and is neither all right nor all wrong (stage 4 does not keep it, as it
keeps no group without contrast; `zve/missing_outcome_groups` counts it).
`failed_reward_fraction` is the share of a batch's responses whose reward call failed. This
module imports neither JAX nor the buffer's I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from espo_jax.buffer.records import RolloutGroup


def binary_outcomes(outcomes: Iterable | None, prompt_id: str = "") -> np.ndarray:
    """Outcomes as an int array, checked to be 0/1 (filtering never uses shaped rewards)."""
    if outcomes is None:  # `RolloutGroup.outcomes` of a group with an unscored response
        raise ValueError(f"outcomes of {prompt_id!r}: the group is not scored (an outcome is "
                         f"None)")
    o = np.asarray(list(outcomes), dtype=np.float64)
    if o.ndim != 1 or o.size == 0:
        raise ValueError(f"outcomes of {prompt_id!r} must be a non-empty 1-D sequence")
    if not np.all((o == 0) | (o == 1)):
        raise ValueError(f"outcomes of {prompt_id!r} must be binary 0/1 (MS-ZVE uses the "
                         f"verified outcome, never a shaped reward); got {o.tolist()}")
    return o.astype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class ScoredGroup:
    """One rollout group and MS-ZVE's rewards for it (float32 `[G]`, read-only): its binary
    outcomes, or with stage 2 on the tie-broken rewards. Compared by identity (the online
    filter tracks the groups it keeps)."""

    group: RolloutGroup
    rewards: np.ndarray

    def __post_init__(self):
        rewards = np.asarray(self.rewards, np.float32).view()  # read-only view, same values
        if rewards.shape != (self.group.num_responses,):
            raise ValueError(f"ScoredGroup: group {self.group.prompt_id!r} has "
                             f"{self.group.num_responses} responses but rewards of shape "
                             f"{rewards.shape}")
        rewards.setflags(write=False)
        object.__setattr__(self, "rewards", rewards)

    @property
    def prompt_id(self) -> str | int:
        return self.group.prompt_id

    @property
    def outcomes(self) -> np.ndarray:
        """int64 `[G]` binary outcomes (checked)."""
        return binary_outcomes(self.group.outcomes, str(self.group.prompt_id))

    @property
    def lengths(self) -> np.ndarray:
        """int64 `[G]` response lengths (tokens)."""
        return self.group.response_lengths.astype(np.int64)


class UnscoredGroupError(ValueError):
    """A group reached the learner with a response whose `outcome` or `reward` is None: its
    rollout worker did not score it. Names the prompt, the sampler and the worker."""

    def __init__(self, prompt_id: str | int, sampler: str, worker: str, n_unscored: int):
        self.prompt_id, self.sampler, self.worker = prompt_id, sampler, worker
        super().__init__(
            f"group for prompt {prompt_id!r} from sampler {sampler!r} (worker {worker!r}) has "
            f"{n_unscored} unscored responses (outcome or reward is None): the rollout worker "
            "did not score it; the learner does not train on unscored groups")


def _rollout_group(group: RolloutGroup | ScoredGroup) -> RolloutGroup:
    return group.group if isinstance(group, ScoredGroup) else group


def require_scored(groups: Iterable[RolloutGroup | ScoredGroup]) -> None:
    """Raises `UnscoredGroupError` for the first group with an unscored response."""
    for group in map(_rollout_group, groups):
        unscored = sum(r.outcome is None or r.reward is None for r in group.responses)
        if unscored:
            raise UnscoredGroupError(group.prompt_id, group.sampler,
                                     str(group.meta.get("worker", "?")), unscored)


def reward_failed(group: RolloutGroup | ScoredGroup) -> np.ndarray:
    """bool `[G]`: True where the response's reward call failed or timed out, from the indices
    the rollout side lists in `meta["reward_failed"]` (none listed: all False)."""
    g = _rollout_group(group)
    listed = g.meta.get("reward_failed", [])
    valid = isinstance(listed, list | tuple) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < g.num_responses
        for i in listed)
    if not valid or len(set(listed)) != len(listed):
        raise ValueError(f"group {g.prompt_id!r}: meta['reward_failed'] must list distinct "
                         f"response indices in [0, {g.num_responses}) (the responses whose "
                         f"reward call failed), got {listed!r}")
    mask = np.zeros(g.num_responses, bool)
    mask[list(listed)] = True
    return mask


def known_outcomes(group: RolloutGroup | ScoredGroup) -> np.ndarray:
    """int64 `[k]` binary outcomes of the responses whose reward call succeeded, in response
    order (k = G less the failed ones; 0 when every reward call failed)."""
    g = _rollout_group(group)
    return binary_outcomes(g.outcomes, str(g.prompt_id))[~reward_failed(g)]


def failed_reward_fraction(groups: Sequence[RolloutGroup | ScoredGroup]) -> float:
    """The share of the groups' responses whose reward call failed or timed out
    (`reward_failed`); 0.0 for no responses."""
    groups = [_rollout_group(g) for g in groups]
    responses = sum(g.num_responses for g in groups)
    failed = sum(int(reward_failed(g).sum()) for g in groups)
    return failed / responses if responses else 0.0


def groups_and_rewards(batch: Sequence[ScoredGroup]
                       ) -> tuple[list[RolloutGroup], list[np.ndarray]]:
    """A batch of `ScoredGroup`s as the learner takes it: the groups and a parallel list of
    their reward arrays."""
    return [s.group for s in batch], [s.rewards for s in batch]
