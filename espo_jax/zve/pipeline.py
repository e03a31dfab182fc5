"""MS-ZVE in one object for a training loop: scheduler + tie-break + online filter + metrics.

    zve = ZVEPipeline(prompts, cfg.zve, seed=0, max_len=cfg.max_response_len)
    zve.offline_prune(rollout)                       # stage 0 (no-op when off)
    for step in range(steps):
        batch, metrics = zve.step(groups_per_step, rollout)
        groups, rewards = groups_and_rewards(batch)
        state, _ = learner.update(state, groups, rewards)  # stage 3 in its advantages

`rollout(plan)` is the caller's generation + verification: for a list of (prompt dict,
n_samples) it returns one scored `espo_jax.buffer.RolloutGroup` per entry (binary outcomes,
the responses' tokens; step credits in `reward_components` for stage 2's `step_credit`).
`step` returns `ScoredGroup`s: each group with its float32 rewards (the outcome, or the
stage-2 shaped reward). No group is written to. With every stage off this is plain GRPO
sampling, so one loop measures every combination of stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import ml_collections

from espo_jax.zve.groups import ScoredGroup
from espo_jax.zve.metrics import length_metrics, step_metrics
from espo_jax.zve.offline import offline_pass
from espo_jax.zve.online_filter import OnlineFilter
from espo_jax.zve.scheduler import PromptScheduler
from espo_jax.zve.tie_break import score_groups

if TYPE_CHECKING:
    from espo_jax.buffer.records import RolloutGroup

Rollout = Callable[[list[tuple[Mapping, int]]], Sequence["RolloutGroup"]]


class ZVEPipeline:
    """See the module docstring. `scheduler` and `filter` stay accessible for finer control."""

    def __init__(self, prompts: Sequence[Mapping], config: ml_collections.ConfigDict,
                 seed: int = 0, *, max_len: int):
        self.config, self.max_len = config, int(max_len)
        self.scheduler = PromptScheduler(prompts, config, seed)
        self.filter = OnlineFilter.for_zve(config)

    def _rollout(self, rollout: Rollout, plan: list[tuple[Mapping, int]]) -> list[RolloutGroup]:
        groups = list(rollout(plan))
        if len(groups) != len(plan):
            raise ValueError(f"rollout returned {len(groups)} groups for a plan of {len(plan)}")
        for g, (prompt, n) in zip(groups, plan, strict=True):
            if str(g.prompt_id) != str(prompt["prompt_id"]) or g.num_responses != n:
                raise ValueError(f"rollout: group for {g.prompt_id!r} with "
                                 f"{g.num_responses} outcomes does not match the plan entry "
                                 f"{prompt['prompt_id']!r} x {n}")
        return groups

    def offline_prune(self, rollout: Rollout) -> tuple[list[str], dict[str, float]]:
        """Stage 0: up to k samples per prompt, pass rates, pruning. Returns (pruned ids,
        metrics). With `offline.early_stop`, one sample per prompt per `rollout` call, and only
        for prompts that more samples could still prune (`zve.offline.offline_undecided`)."""
        return offline_pass(self.scheduler, lambda plan: self._rollout(rollout, plan))

    def _generate(self, rollout: Rollout, n_groups: int) -> list[ScoredGroup]:
        groups = self._rollout(rollout, self.scheduler.next_prompts(n_groups))
        self.scheduler.observe_groups(groups)
        return score_groups(groups, self.config.tie_break, self.max_len)

    def step(self, n_groups: int, rollout: Rollout
             ) -> tuple[list[ScoredGroup], dict[str, float]]:
        """One step's training groups (with their rewards) and its flat `zve/...` and
        `lengths/...` metrics (`zve.metrics`)."""
        result = self.filter.collect(n_groups, lambda n: self._generate(rollout, n))
        metrics = step_metrics(result.generated, result.batch,
                               zvp_enabled=self.config.zvp.enabled,
                               zvp_wrong=self.config.zvp.wrong_groups)
        metrics.update(length_metrics(result.generated, result.batch))
        metrics.update(self.scheduler.pop_metrics())
        metrics.update(self.filter.metrics(result))
        return result.batch, metrics

    def state_dict(self) -> dict:
        """JSON-serialisable: the scheduler's state and the filter's counters."""
        return {"scheduler": self.scheduler.state_dict(),
                "filter": {"exhausted": self.filter.exhausted, "steps": self.filter.steps,
                           "keep_rate": self.filter.keep_rate}}

    def load_state_dict(self, state: Mapping) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.filter.exhausted = int(state["filter"]["exhausted"])
        self.filter.steps = int(state["filter"]["steps"])
        self.filter.keep_rate = float(state["filter"]["keep_rate"])
