"""MS-ZVE stage 5 (`zve.retire`): cross-epoch retirement and periodic re-probing.

A prompt whose last `solved_streak` visits were all right (or `failed_streak` all wrong) is
retired; every `reprobe_every` epochs it is re-probed with `reprobe_samples` samples and comes
back when the probe's outcomes are mixed. About reprobe_frac x (active prompts) re-probes join
an epoch (longest-waiting first; fractions carry over; at least one when no prompt is active):
when most prompts are retired, epochs are short, and probing all of them every few epochs
would spend more on probes than on training. With `offline.reprobe_pruned`, prompts pruned by
stage 0 are re-probed the same way.

The state (status, streaks, next probe epochs, the probe credit, counters) lives in
`PromptScheduler`; these functions read and update it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from espo_jax.zve.status import ACTIVE, PRUNED, RETIRED

PromptScheduler = Any  # `zve.scheduler.PromptScheduler`, which imports this module


def outcome_sign(right: int, n: int) -> int:
    """+1: all n outcomes right; -1: all wrong; 0: mixed."""
    return 1 if right == n else (-1 if right == 0 else 0)


def next_streak(streak: int, sign: int) -> int:
    """The streak after a visit of `outcome_sign` `sign` (+k: the last k visits all right;
    -k: all wrong; 0: the last visit was mixed)."""
    if sign == 0:
        return 0
    if np.sign(streak) == sign:
        return streak + sign
    return sign


def _reprobed(s: PromptScheduler, status: str) -> bool:
    return status == RETIRED or (status == PRUNED and s.config.offline.reprobe_pruned)


def probes_due(s: PromptScheduler, n_active: int) -> list[int]:
    """Indices of the prompts re-probed in the epoch `s.epoch` now starting (with `n_active`
    active prompts); sets their next probe epoch and spends the probe credit."""
    r = s.config.retire
    due = [i for i, status in enumerate(s.status)
           if _reprobed(s, status) and s.next_probe[i] <= s.epoch]
    # longest-waiting first, as many as the credit allows; the rest stay due. The credit
    # carries fractions over (0.05 x 30 active = 1.5: 1 probe, then 2, ...).
    due.sort(key=lambda i: (s.next_probe[i], i))
    s.probe_credit = min(s.probe_credit + r.reprobe_frac * n_active, float(len(due)))
    n_probes = int(s.probe_credit) if n_active else max(1, int(s.probe_credit))
    s.probe_credit = max(s.probe_credit - n_probes, 0.0)
    probes = due[:n_probes]
    for i in probes:
        s.next_probe[i] = s.epoch + r.reprobe_every
    return probes


def after_visit(s: PromptScheduler, i: int, sign: int) -> None:
    """Status of prompt i after a visit (its streak already updated): a mixed re-probe result
    brings a retired or pruned prompt back; a long enough streak retires an active one."""
    if s.status[i] in (RETIRED, PRUNED):  # a re-probe result
        if sign == 0:
            s.status[i] = ACTIVE
            s._step["revived"] += 1
            s.totals["revived"] += 1
        return
    r = s.config.retire
    if r.enabled and (s.streak[i] >= r.solved_streak or -s.streak[i] >= r.failed_streak):
        s.status[i] = RETIRED
        s.next_probe[i] = s.epoch + r.reprobe_every
        s._step["retired_new"] += 1
        s.totals["retired"] += 1


def can_recover(s: PromptScheduler) -> bool:
    """Whether some later epoch can still have something to sample (a re-probe can revive)."""
    return s.config.retire.enabled and any(_reprobed(s, status) for status in s.status)
