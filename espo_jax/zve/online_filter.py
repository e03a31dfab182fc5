"""MS-ZVE stage 4 (`zve.online_filter`): online filtering of zero-variance groups, bounded refill.

DAPO-style dynamic sampling: request more groups than still needed, drop the groups whose
binary outcomes are all equal, and refill at most `max_refill_rounds` times. The request is
missing / keep_rate (rounded, at least `missing`), with keep_rate a running estimate (halved
weight per round) of the fraction of groups kept, starting at 1 / `oversample` and never
asking for more than `oversample` times what is missing: a fixed over-sample factor would throw
away a third of the (informative) groups whenever most groups are informative. When
the rounds run out the step trains on what it has: a `RuntimeWarning` names the numbers, the
`exhausted` counter goes up, and (with `pad_with_filtered`) dropped groups top the batch up to
its static size (they carry no GRPO gradient, but do carry RL-ZVP signal when stage 3 is on).
It never raises for lack of informative groups: a run must not die because its prompts became
too easy.

With stage 3 (RL-ZVP) on, a zero-variance group is not without signal: RL-ZVP gives it an
entropy-guided advantage. Dropping it would throw away tokens that carry gradient (measured on
arith_chains when the filter still dropped them: 8% no-signal tokens without the filter, 42% with
it), so `OnlineFilter.for_zve` builds the filter with `keep_zero_variance=True` then, and the
stage passes every group through: it only acts for losses that get nothing from a
zero-variance group.

A group is a `ScoredGroup` in MS-ZVE (its rewards are read by `zve.metrics`), or a
`RolloutGroup`. Filtering reads the known binary outcomes only (`zve.groups.known_outcomes`: a
response whose reward call failed or timed out is missing, not wrong), never a shaped reward;
"all equal" is `espo_jax.rl.advantages.zero_variance` over the known outcomes, so [right,
right, timeout] is an all-right zero-variance group. A group with no known outcome has no
contrast and is neither all right nor all wrong: the filter does not keep it (with stage 3 on
and `zvp.wrong_groups`, when the stage passes every group, it goes through like any other).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ml_collections
import numpy as np

from espo_jax.zve.groups import binary_outcomes, known_outcomes

Group = Any  # a `ScoredGroup` (MS-ZVE) or a `RolloutGroup`


def filter_groups(groups_outcomes: Iterable[Iterable]) -> np.ndarray:
    """Bool keep mask: True where a group's (known) binary outcomes are not all equal; False
    for a group with none (every reward call failed: no contrast).

    Groups may differ in size (stage 1 gives prompts different sample counts).
    """
    from espo_jax.rl.advantages import zero_variance  # imports JAX (the module; not this call)

    keep = []
    for k, outcomes in enumerate(groups_outcomes):
        values = list(outcomes)
        o = binary_outcomes(values, f"group {k}") if values else None
        keep.append(o is not None and not bool(zero_variance(o[None])[0]))
    return np.asarray(keep, dtype=bool)


@dataclasses.dataclass
class CollectResult:
    """One step's groups: what to train on and everything generated for it."""

    batch: list  # groups to train on, in generation order
    generated: list  # every group generated this step, all rounds, in order
    rounds: int  # generation rounds (1 + refills)
    exhausted: bool  # refill rounds ran out before `target` informative groups
    padded: int  # zero-variance groups put into `batch` to reach `target`
    surplus: int  # informative groups generated but beyond `target` (not trained on)


class OnlineFilter:
    """Stage 4 around a caller's `generate(n_groups) -> list of groups` function.

    With the stage disabled (or `keep_zero_variance`: every group has signal), `collect` calls
    `generate(target)` once and returns all of it, so a driver loop is the same either way.
    """

    def __init__(self, config: ml_collections.ConfigDict, keep_zero_variance: bool = False,
                 keep_wrong: bool = True):
        """`config` is the `online_filter` sub-config of `default_zve_config()`;
        `keep_zero_variance`: zero-variance groups carry signal (RL-ZVP on), drop nothing;
        without `keep_wrong` (`zve.zvp.wrong_groups=False`) only all-correct ones do, and
        all-wrong zero-variance groups are dropped as without RL-ZVP."""
        if config.oversample < 1.0 or config.max_refill_rounds < 0:
            raise ValueError(f"OnlineFilter: need oversample >= 1 and max_refill_rounds >= 0, "
                             f"got {config.oversample}, {config.max_refill_rounds}")
        self.config, self.keep_zero_variance = config, bool(keep_zero_variance)
        self.keep_wrong = bool(keep_wrong)
        self.exhausted = 0  # steps that ran out of refill rounds (cumulative)
        self.steps = 0
        self.keep_rate = 1.0 / config.oversample  # running fraction of groups kept

    @classmethod
    def for_zve(cls, zve_config: ml_collections.ConfigDict) -> OnlineFilter:
        """Stage 4 as MS-ZVE runs it (`zve_config` = `default_zve_config()`'s shape): RL-ZVP
        gives zero-variance groups signal, so with stage 3 on the filter keeps them."""
        return cls(zve_config.online_filter, keep_zero_variance=zve_config.zvp.enabled,
                   keep_wrong=zve_config.zvp.wrong_groups)

    def _request(self, missing: int) -> int:
        factor = min(self.config.oversample, 1.0 / max(self.keep_rate, 1e-6))
        return max(missing, math.floor(missing * factor + 0.5))

    def collect(self, target: int, generate: Callable[[int], Sequence[Group]]) -> CollectResult:
        """Groups for one step of `target` groups; see the module docstring."""
        if target < 1:
            raise ValueError(f"OnlineFilter.collect: target must be >= 1, got {target}")
        self.steps += 1
        cfg = self.config
        if not cfg.enabled or (self.keep_zero_variance and self.keep_wrong):
            generated = list(generate(target))
            return CollectResult(batch=generated, generated=generated, rounds=1,
                                 exhausted=False, padded=0, surplus=0)
        generated: list = []
        kept: list = []
        rounds = 0
        while True:
            groups = list(generate(self._request(target - len(kept))))
            rounds += 1
            generated += groups
            known = [known_outcomes(g) for g in groups]
            mask = filter_groups(known)
            if self.keep_zero_variance:  # RL-ZVP's all-correct groups carry signal
                mask |= np.array([o.size > 0 and bool(np.all(o > 0)) for o in known],
                                 dtype=bool)
            kept += [g for g, k in zip(groups, mask, strict=True) if k]
            if groups:
                self.keep_rate = 0.5 * self.keep_rate + 0.5 * float(mask.mean())
            if len(kept) >= target or rounds > cfg.max_refill_rounds:
                break
        exhausted = len(kept) < target
        batch, padded = kept[:target], 0
        if exhausted:
            self.exhausted += 1
            if cfg.pad_with_filtered:
                kept_ids = {id(g) for g in kept}
                fill = [g for g in generated if id(g) not in kept_ids][: target - len(kept)]
                padded = len(fill)
                order = {id(g): j for j, g in enumerate(generated)}
                batch = sorted(kept + fill, key=lambda g: order[id(g)])
            warnings.warn(
                f"OnlineFilter: {len(kept)} of {target} groups have outcome variance after "
                f"{rounds} rounds ({len(generated)} groups generated, max_refill_rounds="
                f"{cfg.max_refill_rounds}); training on {len(batch)} groups "
                f"({padded} zero-variance padding). Exhausted {self.exhausted} time(s).",
                RuntimeWarning, stacklevel=2)
        return CollectResult(batch=batch, generated=generated, rounds=rounds,
                             exhausted=exhausted, padded=padded,
                             surplus=max(len(kept) - target, 0))

    def metrics(self, result: CollectResult) -> dict[str, float]:
        """Flat `zve/...` scalars of one `collect` (plus the cumulative exhaustion counter)."""
        return {
            "zve/refill_rounds": float(result.rounds - 1),
            "zve/refill_exhausted": float(self.exhausted),
            "zve/filter_padded": float(result.padded),
            "zve/filter_surplus": float(result.surplus),
        }
