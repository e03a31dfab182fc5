"""Which prompts to sample next, and how many samples each: the history MS-ZVE stages 0, 1, 5
decide from.

A group whose samples all get the same binary outcome gives group-relative losses no gradient.
`PromptScheduler` keeps every prompt's history (decayed pass-rate counts, visits, streaks,
status) and draws epochs from it; the stages' rules are in their modules:

- stage 0 (`offline`): prune prompts the starting policy always (or never) solves;
- stage 1 (`adaptive`): samples per prompt from its pass-rate estimate; settled prompts skipped;
- stage 5 (`retire`): retire prompts after a streak of equal outcomes, re-probe them later.

The history holds known outcomes only: a response whose reward call failed or timed out is
missing, not wrong (`zve.groups.known_outcomes`), so a timeout never makes a prompt look hard.

Epochs: every active prompt once, in a permutation drawn from (seed, epoch), with the re-probes
due that epoch mixed in. Everything is deterministic given the seed and the observations, and
`state_dict()` (JSON-serialisable) restores a scheduler that continues identically.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import ml_collections
import numpy as np

from espo_jax.zve import adaptive, offline, retire
from espo_jax.zve.config import validate_zve_config
from espo_jax.zve.groups import binary_outcomes, reward_failed
from espo_jax.zve.status import ACTIVE, NORMAL, PROBE, PRUNED, RETIRED

if TYPE_CHECKING:
    from espo_jax.buffer.records import RolloutGroup

__all__ = ["ACTIVE", "NORMAL", "PROBE", "PRUNED", "RETIRED", "PromptScheduler"]

_STATE_VERSION = 1
# Epochs in a row with nothing to sample (beyond the re-probe interval) -> an error, not a hang.
_EMPTY_EPOCHS_BEFORE_ERROR = 1000


class PromptScheduler:
    """Draws (prompt, n_samples) pairs and learns from the observed binary outcomes.

    Args:
      prompts: prompt dicts with a unique "prompt_id" (espo_jax.data.prompts); returned as is.
      config: `default_zve_config()` or an edited copy.
      seed: fixes the order of every epoch.
    """

    def __init__(self, prompts: Sequence[Mapping], config: ml_collections.ConfigDict,
                 seed: int = 0):
        validate_zve_config(config)
        ids = [str(p["prompt_id"]) for p in prompts]
        if not ids:
            raise ValueError("PromptScheduler: no prompts")
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"PromptScheduler: prompt_id {dup!r} appears more than once")
        self.prompts, self.config, self.seed = list(prompts), config, int(seed)
        self._ids = ids
        self._index = {pid: i for i, pid in enumerate(ids)}
        n = len(ids)
        self.succ, self.trials = [0.0] * n, [0.0] * n  # decayed counts (stage 1)
        self.visits = [0] * n
        self.streak = [0] * n  # +k: last k visits all right; -k: all wrong; 0: mixed
        self.status = [ACTIVE] * n
        self.next_probe = [0] * n  # epoch at which a retired/pruned prompt is probed next
        self.epoch, self.cursor = -1, 0
        self.probe_credit = 0.0  # fractional re-probes carried to the next epoch
        self.order: list[tuple[int, int]] = []
        self.totals = self._empty_totals()
        self._step = self._empty_step()

    # -- stage 0 -------------------------------------------------------------------------------

    def offline_plan(self) -> list[tuple[Mapping, int]]:
        """Every prompt with `offline.k` samples: what the caller generates for `offline_prune`."""
        return [(p, self.config.offline.k) for p in self.prompts]

    def offline_prune(self, pass_rates: Mapping[str, float],
                      counts: Mapping[str, int] | None = None) -> list[str]:
        """Stage 0: prunes prompts with pass rate <= low or >= high; returns their ids.

        The estimates also seed the history for stage 1, as `counts[pid]` samples each (default
        `offline.k`: a prompt sampled fewer times by the early stop counts what it got). A no-op
        returning [] when stage 0 is disabled, so a driver can call it unconditionally.
        """
        return offline.prune(self, pass_rates, counts)

    # -- drawing -------------------------------------------------------------------------------

    def pass_rate(self, prompt_id: str) -> float:
        """Stage 1's estimate (s + prior) / (t + 2 prior) for one prompt."""
        i = self._lookup(prompt_id)
        return adaptive.pass_rate(self.succ[i], self.trials[i], self.config.adaptive)

    def samples_for(self, prompt_id: str) -> int:
        """Samples the prompt would get now as a normal (not re-probe) entry."""
        i = self._lookup(prompt_id)
        return adaptive.samples(self.succ[i], self.trials[i], self.config)

    def next_prompts(self, n: int) -> list[tuple[Mapping, int]]:
        """The next n (prompt, n_samples) pairs; crosses epoch boundaries as needed."""
        if n < 0:
            raise ValueError(f"next_prompts: n must be >= 0, got {n}")
        out: list[tuple[Mapping, int]] = []
        empty_epochs, emitted_at_epoch_start = 0, 0
        while len(out) < n:
            if self.cursor >= len(self.order):
                # epochs that emit nothing (all retired, or all settled and skipped) are
                # bounded: skipping ages evidence and re-probes come due, else this is an error
                empty_epochs = empty_epochs + 1 if len(out) == emitted_at_epoch_start else 0
                emitted_at_epoch_start = len(out)
                self._start_epoch()
                limit = _EMPTY_EPOCHS_BEFORE_ERROR + self.config.retire.reprobe_every
                if empty_epochs > limit or (
                        not self.order and not retire.can_recover(self)):
                    raise RuntimeError(self._nothing_left_message())
                continue
            i, kind = self.order[self.cursor]
            self.cursor += 1
            if kind == PROBE:
                samples = self.config.retire.reprobe_samples
                self._step["reprobed"] += 1
                self.totals["reprobed"] += 1
            elif self.status[i] != ACTIVE:  # retired earlier in this epoch
                continue
            else:
                samples = self.samples_for(self._ids[i])
                if samples == 0:  # settled: skip, and let its evidence age
                    self.succ[i], self.trials[i] = adaptive.skipped(
                        self.succ[i], self.trials[i], self.config.adaptive)
                    self._step["skipped_settled"] += 1
                    self.totals["skipped_settled"] += 1
                    continue
            out.append((self.prompts[i], samples))
            self._step["samples"] += samples
            self._step["prompts"] += 1
        return out

    def _start_epoch(self) -> None:
        self.epoch += 1
        self.cursor = 0
        entries = [(i, NORMAL) for i, s in enumerate(self.status) if s == ACTIVE]
        if self.config.retire.enabled:
            entries += [(i, PROBE) for i in retire.probes_due(self, len(entries))]
        rng = np.random.default_rng([self.seed, self.epoch])
        self.order = [entries[j] for j in rng.permutation(len(entries))]

    def _nothing_left_message(self) -> str:
        counts = {s: self.status.count(s) for s in (ACTIVE, RETIRED, PRUNED)}
        return (f"PromptScheduler: nothing to sample: {counts} of {len(self.status)} prompts "
                "(enable retire with reprobe, or loosen offline.low/high)")

    # -- observing -----------------------------------------------------------------------------

    def observe(self, prompt_id: str, outcomes: Iterable, lengths: Iterable | None = None,
                failed: Iterable | None = None) -> None:
        """Records one generated group's binary outcomes (stages 1 and 5).

        `failed` (bool per response, default none) marks responses whose reward call failed or
        timed out: their outcomes are missing, not wrong, and only the others count (pass-rate
        counts, streak). A group with no known outcome leaves the history as it was (a retired
        prompt re-probed so stays retired until its next probe). Missing outcomes add up in
        `totals["missing_outcomes"]` (in a worker's status: `zve/missing_outcomes_total`).
        `lengths` (tokens per response) is accepted for symmetry with the group records and
        checked for size; metrics are computed by `zve.metrics.step_metrics`.
        """
        i = self._lookup(prompt_id)
        o = binary_outcomes(outcomes, prompt_id)
        if lengths is not None and len(list(lengths)) != len(o):
            raise ValueError(f"observe: {prompt_id!r} has {len(o)} outcomes but "
                             f"{len(list(lengths))} lengths")
        missing = np.zeros(len(o), bool) if failed is None else np.asarray(list(failed), bool)
        if missing.shape != o.shape:
            raise ValueError(f"observe: {prompt_id!r} has {len(o)} outcomes but "
                             f"{missing.size} failed flags")
        self.totals["missing_outcomes"] += int(missing.sum())
        known = o[~missing]
        if not known.size:
            return
        right = int(known.sum())
        self.succ[i], self.trials[i] = adaptive.observed(
            self.succ[i], self.trials[i], right, len(known), self.config.adaptive)
        self.visits[i] += 1
        sign = retire.outcome_sign(right, len(known))
        self.streak[i] = retire.next_streak(self.streak[i], sign)
        retire.after_visit(self, i, sign)

    def observe_groups(self, groups: Iterable[RolloutGroup]) -> None:
        """`observe` for rollout groups (their prompt ids, outcomes, response lengths and
        failed reward calls, `zve.groups.reward_failed`)."""
        for g in groups:
            self.observe(g.prompt_id, g.outcomes, g.response_lengths, reward_failed(g))

    # -- metrics and state ---------------------------------------------------------------------

    @staticmethod
    def _empty_step() -> dict[str, int]:
        return dict(prompts=0, samples=0, retired_new=0, reprobed=0, revived=0,
                    skipped_settled=0)

    @staticmethod
    def _empty_totals() -> dict[str, int]:
        return dict(retired=0, revived=0, reprobed=0, pruned=0, skipped_settled=0,
                    missing_outcomes=0)

    def pop_metrics(self) -> dict[str, float]:
        """Flat `zve/...` scalars since the last call (counts of this step, current sizes)."""
        s, self._step = self._step, self._empty_step()
        return {
            "zve/epoch": float(max(self.epoch, 0)),
            "zve/active": float(self.status.count(ACTIVE)),
            "zve/retired": float(self.status.count(RETIRED)),
            "zve/pruned": float(self.status.count(PRUNED)),
            "zve/retired_new": float(s["retired_new"]),
            "zve/reprobed": float(s["reprobed"]),
            "zve/revived": float(s["revived"]),
            "zve/skipped_settled": float(s["skipped_settled"]),
            "zve/samples_per_prompt": s["samples"] / s["prompts"] if s["prompts"] else 0.0,
        }

    def state_dict(self) -> dict:
        """JSON-serialisable state (history, epoch order and position, counters)."""
        return dict(
            version=_STATE_VERSION, seed=self.seed, prompt_ids_sha1=self._ids_digest(),
            epoch=self.epoch, cursor=self.cursor, order=[list(e) for e in self.order],
            probe_credit=self.probe_credit,
            succ=list(self.succ), trials=list(self.trials), visits=list(self.visits),
            streak=list(self.streak), status=list(self.status),
            next_probe=list(self.next_probe), totals=dict(self.totals), step=dict(self._step))

    def load_state_dict(self, state: Mapping) -> None:
        """Restores `state_dict()` output; the prompts must be the same ids in the same order."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"PromptScheduler: state version {state.get('version')} != "
                             f"{_STATE_VERSION}")
        if state["prompt_ids_sha1"] != self._ids_digest():
            raise ValueError("PromptScheduler: the state was saved for a different prompt list "
                             "(ids or order differ)")
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self.order = [(int(i), int(k)) for i, k in state["order"]]
        self.probe_credit = float(state["probe_credit"])
        self.succ, self.trials = list(state["succ"]), list(state["trials"])
        self.visits, self.streak = list(state["visits"]), list(state["streak"])
        self.status, self.next_probe = list(state["status"]), list(state["next_probe"])
        # a state saved without the missing-outcome total starts it at 0
        self.totals = {**self._empty_totals(), **state["totals"]}
        self._step = dict(state["step"])

    @classmethod
    def from_state_dict(cls, state: Mapping, prompts: Sequence[Mapping],
                        config: ml_collections.ConfigDict) -> PromptScheduler:
        """A scheduler over `prompts` that continues exactly where `state` was saved."""
        sched = cls(prompts, config, seed=state["seed"])
        sched.load_state_dict(state)
        return sched

    def _ids_digest(self) -> str:
        return hashlib.sha1("\n".join(self._ids).encode()).hexdigest()

    def _lookup(self, prompt_id: str) -> int:
        try:
            return self._index[str(prompt_id)]
        except KeyError:
            raise KeyError(f"PromptScheduler: unknown prompt_id {prompt_id!r}") from None
