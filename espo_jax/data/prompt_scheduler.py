"""Which prompts to sample next, and how many samples each: MS-ZVE stages 0, 1 and 5.

A group whose samples all get the same binary outcome gives group-relative losses no gradient.
The scheduler avoids generating such groups, from each prompt's history:

- stage 0 (`offline_prune`): prompts whose offline pass rate (k samples from the starting
  policy, drawn by the caller from `offline_plan()`) is <= low or >= high are pruned; with
  `early_stop` the caller draws one sample per round and stops a prompt as soon as no outcome
  of its remaining samples could prune it (`offline_undecided`), which is the same decision
  for a fraction of the samples;
- stage 1 (adaptive samples): with p the prompt's pass-rate estimate, a group of n samples is
  all-equal with probability p^n + (1-p)^n. The prompt gets the smallest n in
  [min_samples, max_samples] (rounded up to `multiple`) with that probability <= target_zv. A
  prompt for which even max_samples is not enough is *settled*: it gets `settled_samples`
  (0 = skipped this epoch). p = (s + prior) / (t + 2 prior) over decayed counts (s right out of
  t samples; each visit or skip multiplies the old counts by `decay`, so a skipped prompt's
  evidence ages until it is sampled again). Below `min_obs` decayed samples, n = n_samples;
- stage 5 (retirement): a prompt whose last `solved_streak` visits were all right (or
  `failed_streak` all wrong) is retired; every `reprobe_every` epochs it is re-probed with
  `reprobe_samples` samples and comes back when the probe's outcomes are mixed. About
  reprobe_frac x (active prompts) re-probes join an epoch (longest-waiting first; fractions
  carry over; at least one when no prompt is active): when most prompts are retired, epochs are
  short, and probing all of them every few epochs would spend more on probes than on training.

Epochs: every active prompt once, in a permutation drawn from (seed, epoch), with the re-probes
due that epoch mixed in. Everything is deterministic given the seed and the observations, and
`state_dict()` (JSON-serialisable) restores a scheduler that continues identically.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence

import ml_collections
import numpy as np

from espo_jax.data.zve_config import validate_zve_config

ACTIVE, RETIRED, PRUNED = "active", "retired", "pruned"
NORMAL, PROBE = 0, 1  # kinds of entries in an epoch's order
_STATE_VERSION = 1
# Epochs in a row with nothing to sample (beyond the re-probe interval) -> an error, not a hang.
_EMPTY_EPOCHS_BEFORE_ERROR = 1000


def offline_undecided(successes: int, samples: int, cfg: ml_collections.ConfigDict) -> bool:
    """Stage 0's early stop: True while more samples could still prune the prompt.

    After `successes` right of `samples` (of `cfg.k`), the final pass rate lies in
    [s / k, (s + k - samples) / k]; when that interval misses both `rate <= low` and
    `rate >= high`, the prompt is kept whatever the remaining samples say, so drawing them
    would be waste. Pruning decisions are the same as with all k samples drawn.
    """
    if samples >= cfg.k:
        return False
    return (_prunable(successes / cfg.k, cfg)
            or _prunable((successes + cfg.k - samples) / cfg.k, cfg))


def _prunable(rate: float, cfg: ml_collections.ConfigDict) -> bool:
    """Stage 0's rule: a pass rate at or below `low`, or at or above `high`."""
    return rate <= cfg.low or rate >= cfg.high


def zero_variance_prob(p: float, n: int) -> float:
    """P(n Bernoulli(p) outcomes are all equal) = p^n + (1-p)^n."""
    return p**n + (1.0 - p) ** n


def adaptive_samples(p: float, cfg: ml_collections.ConfigDict) -> int:
    """Stage 1 sample count for pass-rate estimate p (`cfg` = the `adaptive` sub-config)."""
    for n in range(cfg.min_samples, cfg.max_samples + 1):
        if zero_variance_prob(p, n) <= cfg.target_zv:
            return min(math.ceil(n / cfg.multiple) * cfg.multiple, cfg.max_samples)
    return cfg.settled_samples


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
        self.totals = dict(retired=0, revived=0, reprobed=0, pruned=0, skipped_settled=0)
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
        cfg = self.config.offline
        if not cfg.enabled:
            return []
        pruned = []
        for pid, rate in pass_rates.items():
            i = self._lookup(pid)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"offline_prune: pass rate of {pid!r} is {rate}, not in [0, 1]")
            n = float(cfg.k if counts is None else counts[pid])
            self.succ[i], self.trials[i] = rate * n, n
            if _prunable(rate, cfg) and self.status[i] == ACTIVE:
                self.status[i] = PRUNED
                self.next_probe[i] = max(self.epoch, 0) + self.config.retire.reprobe_every
                pruned.append(pid)
        self.totals["pruned"] += len(pruned)
        return pruned

    # -- drawing -------------------------------------------------------------------------------

    def pass_rate(self, prompt_id: str) -> float:
        """Stage 1's estimate (s + prior) / (t + 2 prior) for one prompt."""
        i = self._lookup(prompt_id)
        prior = self.config.adaptive.prior
        return (self.succ[i] + prior) / (self.trials[i] + 2 * prior)

    def samples_for(self, prompt_id: str) -> int:
        """Samples the prompt would get now as a normal (not re-probe) entry."""
        a = self.config.adaptive
        i = self._lookup(prompt_id)
        if not a.enabled or self.trials[i] < a.min_obs:
            return self.config.n_samples
        return adaptive_samples(self.pass_rate(prompt_id), a)

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
                        not self.order and not self._can_recover()):
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
                    d = self.config.adaptive.decay
                    self.succ[i], self.trials[i] = self.succ[i] * d, self.trials[i] * d
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
        r = self.config.retire
        if r.enabled:
            due = [i for i, s in enumerate(self.status)
                   if (s == RETIRED or (s == PRUNED and self.config.offline.reprobe_pruned))
                   and self.next_probe[i] <= self.epoch]
            # longest-waiting first, as many as the credit allows; the rest stay due. The
            # credit carries fractions over (0.05 x 30 active = 1.5: 1 probe, then 2, ...).
            due.sort(key=lambda i: (self.next_probe[i], i))
            self.probe_credit = min(self.probe_credit + r.reprobe_frac * len(entries),
                                    float(len(due)))
            n_probes = int(self.probe_credit) if entries else max(1, int(self.probe_credit))
            self.probe_credit = max(self.probe_credit - n_probes, 0.0)
            for i in due[:n_probes]:
                entries.append((i, PROBE))
                self.next_probe[i] = self.epoch + r.reprobe_every
        rng = np.random.default_rng([self.seed, self.epoch])
        self.order = [entries[j] for j in rng.permutation(len(entries))]

    def _can_recover(self) -> bool:
        """Whether some later epoch can still have something to sample."""
        r = self.config.retire
        return r.enabled and any(
            s == RETIRED or (s == PRUNED and self.config.offline.reprobe_pruned)
            for s in self.status)

    def _nothing_left_message(self) -> str:
        counts = {s: self.status.count(s) for s in (ACTIVE, RETIRED, PRUNED)}
        return (f"PromptScheduler: nothing to sample: {counts} of {len(self.status)} prompts "
                "(enable retire with reprobe, or loosen offline.low/high)")

    # -- observing -----------------------------------------------------------------------------

    def observe(self, prompt_id: str, outcomes: Iterable, lengths: Iterable | None = None
                ) -> None:
        """Records one generated group's binary outcomes (stages 1 and 5).

        `lengths` (tokens per response) is accepted for symmetry with the group records and
        checked for size; metrics are computed by `zve_metrics.step_metrics`.
        """
        i = self._lookup(prompt_id)
        o = binary_outcomes(outcomes, prompt_id)
        if lengths is not None and len(list(lengths)) != len(o):
            raise ValueError(f"observe: {prompt_id!r} has {len(o)} outcomes but "
                             f"{len(list(lengths))} lengths")
        d = self.config.adaptive.decay
        right = int(o.sum())
        self.succ[i] = self.succ[i] * d + right
        self.trials[i] = self.trials[i] * d + len(o)
        self.visits[i] += 1
        sign = 1 if right == len(o) else (-1 if right == 0 else 0)
        if sign == 0:
            self.streak[i] = 0
        elif np.sign(self.streak[i]) == sign:
            self.streak[i] += sign
        else:
            self.streak[i] = sign
        if self.status[i] in (RETIRED, PRUNED):  # a re-probe result
            if sign == 0:
                self.status[i] = ACTIVE
                self._step["revived"] += 1
                self.totals["revived"] += 1
            return
        r = self.config.retire
        if r.enabled and (self.streak[i] >= r.solved_streak or -self.streak[i] >= r.failed_streak):
            self.status[i] = RETIRED
            self.next_probe[i] = self.epoch + r.reprobe_every
            self._step["retired_new"] += 1
            self.totals["retired"] += 1

    def observe_groups(self, groups: Iterable[Mapping]) -> None:
        """`observe` for group records with "prompt_id", "outcomes" and optional "lengths"."""
        for g in groups:
            self.observe(g["prompt_id"], g["outcomes"], g.get("lengths"))

    # -- metrics and state ---------------------------------------------------------------------

    @staticmethod
    def _empty_step() -> dict[str, int]:
        return dict(prompts=0, samples=0, retired_new=0, reprobed=0, revived=0,
                    skipped_settled=0)

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
        self.totals, self._step = dict(state["totals"]), dict(state["step"])

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


def binary_outcomes(outcomes: Iterable, prompt_id: str = "") -> np.ndarray:
    """Outcomes as an int array, checked to be 0/1 (filtering never uses shaped rewards)."""
    o = np.asarray(list(outcomes), dtype=np.float64)
    if o.ndim != 1 or o.size == 0:
        raise ValueError(f"outcomes of {prompt_id!r} must be a non-empty 1-D sequence")
    if not np.all((o == 0) | (o == 1)):
        raise ValueError(f"outcomes of {prompt_id!r} must be binary 0/1 (MS-ZVE uses the "
                         f"verified outcome, never a shaped reward); got {o.tolist()}")
    return o.astype(np.int64)
