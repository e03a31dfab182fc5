"""MS-ZVE in one object for a training loop: scheduler + tie-break + online filter + metrics.

    zve = ZVEPipeline(prompts, cfg.zve, seed=0, max_len=cfg.max_response_len)
    zve.offline_prune(rollout)                       # stage 0 (no-op when off)
    for step in range(steps):
        batch, metrics = zve.step(groups_per_step, rollout)
        ...  # advantages from g["rewards"] (stage 3: rl_zvp if cfg.zve.zvp.enabled)

`rollout(plan)` is the caller's generation + verification: for a list of (prompt dict,
n_samples) it returns one group per entry, a dict with at least "prompt_id", "outcomes"
(binary, one per response) and "lengths" (tokens per response); anything else it adds (tokens,
log-probs, routing) is passed through. The pipeline adds "rewards" (float32: the outcome, or the
stage-2 shaped reward) to each group. With every stage off this is plain GRPO sampling, so one
loop measures every combination of stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import ml_collections
import numpy as np

from espo_jax.data.online_filter import OnlineFilter
from espo_jax.data.prompt_scheduler import PromptScheduler, binary_outcomes, offline_undecided
from espo_jax.data.zve_metrics import step_metrics

Rollout = Callable[[list[tuple[Mapping, int]]], Sequence[dict]]


def group_rewards(group: Mapping, tie_break: ml_collections.ConfigDict,
                  max_len: int) -> np.ndarray:
    """float32 rewards of one group: its binary outcomes, or with stage 2 (`tie_break`, the
    `zve.tie_break` config) on, the tie-broken rewards inside the correct tier (and with
    `tie_break.wrong_score="step_credit"`, the group's `credits` inside the wrong tier)."""
    outcomes = binary_outcomes(group["outcomes"], str(group["prompt_id"]))
    if not tie_break.enabled:
        return outcomes.astype(np.float32)
    from espo_jax.rewards.shaping import tie_break_rewards  # imports JAX

    wrong = None
    if tie_break.wrong_score == "step_credit":
        if "credits" not in group:
            raise ValueError(f"zve.tie_break.wrong_score='step_credit': group "
                             f"{group['prompt_id']!r} has no 'credits' (the reward function's "
                             f"step_credit component)")
        wrong = np.asarray(group["credits"], np.float32)
    return tie_break_rewards(outcomes, np.asarray(group["lengths"]), max_len=max_len,
                             prefer=tie_break.prefer, tier_gap=tie_break.tier_gap,
                             band=tie_break.band, wrong_score=wrong)


class ZVEPipeline:
    """See the module docstring. `scheduler` and `filter` stay accessible for finer control."""

    def __init__(self, prompts: Sequence[Mapping], config: ml_collections.ConfigDict,
                 seed: int = 0, *, max_len: int):
        self.config, self.max_len = config, int(max_len)
        self.scheduler = PromptScheduler(prompts, config, seed)
        self.filter = OnlineFilter.for_zve(config)

    def _rollout(self, rollout: Rollout, plan: list[tuple[Mapping, int]]) -> list[dict]:
        groups = list(rollout(plan))
        if len(groups) != len(plan):
            raise ValueError(f"rollout returned {len(groups)} groups for a plan of {len(plan)}")
        for g, (prompt, n) in zip(groups, plan, strict=True):
            if str(g["prompt_id"]) != str(prompt["prompt_id"]) or len(g["outcomes"]) != n:
                raise ValueError(f"rollout: group for {g['prompt_id']!r} with "
                                 f"{len(g['outcomes'])} outcomes does not match the plan entry "
                                 f"{prompt['prompt_id']!r} x {n}")
        return groups

    def offline_prune(self, rollout: Rollout) -> tuple[list[str], dict[str, float]]:
        """Stage 0: up to k samples per prompt, pass rates, pruning. Returns (pruned ids,
        metrics). With `offline.early_stop`, one sample per prompt per `rollout` call, and only
        for prompts that more samples could still prune (`offline_undecided`)."""
        cfg = self.config.offline
        if not cfg.enabled:
            return [], {}
        outcomes: dict[str, list] = {str(p["prompt_id"]): [] for p in self.scheduler.prompts}
        rollouts = tokens = 0

        def draw(plan):
            nonlocal rollouts, tokens
            for g in self._rollout(rollout, plan):
                outcomes[str(g["prompt_id"])] += binary_outcomes(g["outcomes"]).tolist()
                rollouts += len(g["outcomes"])
                tokens += int(np.sum(g["lengths"]))

        if not cfg.early_stop:
            draw(self.scheduler.offline_plan())
        else:
            by_id = {str(p["prompt_id"]): p for p in self.scheduler.prompts}
            while plan := [(by_id[pid], 1) for pid, o in outcomes.items()
                           if offline_undecided(sum(o), len(o), cfg)]:
                draw(plan)
        rates = {pid: float(np.mean(o)) for pid, o in outcomes.items()}
        pruned = self.scheduler.offline_prune(rates, {pid: len(o) for pid, o in outcomes.items()})
        return pruned, {
            "zve/offline_pruned": float(len(pruned)),
            "zve/offline_rollouts": float(rollouts),
            "zve/offline_tokens": float(tokens),
        }

    def _generate(self, rollout: Rollout, n_groups: int) -> list[dict]:
        groups = self._rollout(rollout, self.scheduler.next_prompts(n_groups))
        self.scheduler.observe_groups(groups)
        for g in groups:
            g["rewards"] = group_rewards(g, self.config.tie_break, self.max_len)
        return groups

    def step(self, n_groups: int, rollout: Rollout) -> tuple[list[dict], dict[str, float]]:
        """One step's training groups and its flat `zve/...` metrics."""
        result = self.filter.collect(n_groups, lambda n: self._generate(rollout, n))
        metrics = step_metrics(result.generated, result.batch,
                               zvp_enabled=self.config.zvp.enabled)
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
