"""MS-ZVE stage 0 (`zve.offline`): offline pruning by the starting policy's pass rates.

Prompts whose offline pass rate (k samples from the starting policy) is <= low or >= high are
pruned (`prune`); their estimates also seed stage 1's history. With `early_stop` the caller
draws one sample per round and stops a prompt as soon as no outcome of its remaining samples
could prune it (`offline_undecided`), which is the same decision for a fraction of the samples.
`offline_pass` is the whole stage around a rollout callback (`ZVEPipeline.offline_prune`).

A response whose reward call failed or timed out is missing, not wrong: a prompt's pass rate is
over its known outcomes (`zve.groups.known_outcomes`; 2 right, 1 wrong, 2 timed out: 2/3), and
a prompt none of whose k samples got an outcome has no pass rate: it is kept, its history
unseeded. The early stop bounds the samples drawn per prompt at k, failed ones included.
Metrics: `zve/offline_pruned`, `zve/offline_rollouts`, `zve/offline_tokens`,
`zve/offline_missing_outcomes` (responses whose reward call failed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_collections
import numpy as np

from espo_jax.zve.groups import known_outcomes
from espo_jax.zve.status import ACTIVE, PRUNED

if TYPE_CHECKING:
    from espo_jax.buffer.records import RolloutGroup

PromptScheduler = Any  # `zve.scheduler.PromptScheduler`, which imports this module


def offline_undecided(successes: int, samples: int, cfg: ml_collections.ConfigDict,
                      drawn: int | None = None) -> bool:
    """Stage 0's early stop: True while more samples could still prune the prompt.

    After `successes` right of `samples` known outcomes, from `drawn` (default `samples`) of
    `cfg.k` samples drawn, r = k - drawn remain, and the final pass rate lies in
    [s / (samples + r), (s + r) / (samples + r)] (a remaining sample whose reward call fails
    only moves it inside); when that interval misses both `rate <= low` and `rate >= high`,
    the prompt is kept whatever the remaining samples say, so drawing them would be waste.
    Pruning decisions are the same as with all k samples drawn.
    """
    drawn = samples if drawn is None else drawn
    if not 0 <= successes <= samples <= drawn:
        raise ValueError(f"offline_undecided: need 0 <= successes <= samples <= drawn, got "
                         f"{successes}, {samples}, {drawn}")
    left = cfg.k - drawn
    if left <= 0:
        return False
    final = samples + left
    return prunable(successes / final, cfg) or prunable((successes + left) / final, cfg)


def prunable(rate: float, cfg: ml_collections.ConfigDict) -> bool:
    """Stage 0's rule: a pass rate at or below `low`, or at or above `high`."""
    return rate <= cfg.low or rate >= cfg.high


def prune(s: PromptScheduler, pass_rates: Mapping[str, float],
          counts: Mapping[str, int] | None = None) -> list[str]:
    """`PromptScheduler.offline_prune`: marks prompts pruned, seeds their history; their ids."""
    cfg = s.config.offline
    if not cfg.enabled:
        return []
    pruned = []
    for pid, rate in pass_rates.items():
        i = s._lookup(pid)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"offline_prune: pass rate of {pid!r} is {rate}, not in [0, 1]")
        n = float(cfg.k if counts is None else counts[pid])
        s.succ[i], s.trials[i] = rate * n, n
        if prunable(rate, cfg) and s.status[i] == ACTIVE:
            s.status[i] = PRUNED
            s.next_probe[i] = max(s.epoch, 0) + s.config.retire.reprobe_every
            pruned.append(pid)
    s.totals["pruned"] += len(pruned)
    return pruned


def offline_pass(s: PromptScheduler,
                 draw: Callable[[list[tuple[Mapping, int]]], Sequence[RolloutGroup]]
                 ) -> tuple[list[str], dict[str, float]]:
    """Stage 0 for scheduler `s`: up to k samples per prompt from `draw(plan)` (groups checked
    against the plan), pass rates, pruning. Returns (pruned ids, metrics); ([], {}) when off.
    With `offline.early_stop`, one sample per prompt per `draw` call, and only for prompts that
    more samples could still prune (`offline_undecided`)."""
    cfg = s.config.offline
    if not cfg.enabled:
        return [], {}
    outcomes: dict[str, list] = {str(p["prompt_id"]): [] for p in s.prompts}  # known ones
    drawn = dict.fromkeys(outcomes, 0)
    rollouts = tokens = 0

    def run(plan):
        nonlocal rollouts, tokens
        for g in draw(plan):
            outcomes[str(g.prompt_id)] += known_outcomes(g).tolist()
            drawn[str(g.prompt_id)] += g.num_responses
            rollouts += g.num_responses
            tokens += int(np.sum(g.response_lengths, dtype=np.int64))

    if not cfg.early_stop:
        run(s.offline_plan())
    else:
        by_id = {str(p["prompt_id"]): p for p in s.prompts}
        while plan := [(by_id[pid], 1) for pid, o in outcomes.items()
                       if offline_undecided(sum(o), len(o), cfg, drawn[pid])]:
            run(plan)
    known = {pid: o for pid, o in outcomes.items() if o}  # no outcome: no pass rate, kept
    pruned = s.offline_prune({pid: float(np.mean(o)) for pid, o in known.items()},
                             {pid: len(o) for pid, o in known.items()})
    return pruned, {
        "zve/offline_pruned": float(len(pruned)),
        "zve/offline_rollouts": float(rollouts),
        "zve/offline_tokens": float(tokens),
        "zve/offline_missing_outcomes": float(rollouts - sum(map(len, outcomes.values()))),
    }
