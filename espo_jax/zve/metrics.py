"""Per-step MS-ZVE metrics: how much generation carried no gradient signal, stage by stage.

A group carries no signal for group-relative advantages when its rewards are all equal. With
binary outcomes as rewards that is "all right or all wrong"; stage 2 (tie-breaking) can give an
all-right group distinct rewards; stage 4 drops groups before training; stage 3 (RL-ZVP) gives
every zero-variance group an entropy-guided advantage, so with it every trained group has
signal. The token accounting's names and definitions: `espo_jax.zve.accounting`.

Groups are `ScoredGroup`s (a `RolloutGroup` with MS-ZVE's rewards); "all equal" is
`espo_jax.rl.advantages.zero_variance`, the predicate the learner and the filter use too. By
outcome it is asked of the known outcomes (`zve.groups.known_outcomes`: a response whose reward
call failed or timed out is missing, not wrong): `zve/missing_outcomes` counts the step's
responses without an outcome, `zve/missing_outcome_groups` its groups with none (neither
zero-variance nor not: they leave the by-outcome rates' denominators).

`length_metrics`: response lengths (tokens) of what was generated for the step and of what is
trained on, so that a reader sees whether dropping groups (stage 4, staleness in the worker
layout) tilts training toward short (or long) responses: `lengths/generated_mean`,
`lengths/generated_p90`, `lengths/trained_mean`, `lengths/trained_p90` (p90: numpy's linear
percentile; 0 with no responses). Both loops log them every step beside `zve/...` and
(worker layout) `async/stale_dropped`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from espo_jax.zve.groups import ScoredGroup, known_outcomes, reward_failed


def _flat(values: np.ndarray) -> bool:
    from espo_jax.rl.advantages import zero_variance  # imports JAX (the module; not this call)

    return bool(zero_variance(np.asarray(values, np.float64)[None])[0])


def _zvp_covers(g, zvp_enabled: bool, zvp_wrong: bool) -> bool:
    """Whether RL-ZVP gives group `g` a gradient (`rl.advantages.zvp_signs` is not 0)."""
    if not zvp_enabled:
        return False
    from espo_jax.rl.advantages import zvp_signs

    rewards = np.asarray(g.rewards, np.float64)[None]
    outcomes = np.asarray(g.outcomes, np.float64)[None]
    return bool(zvp_signs(rewards, outcomes, zvp_wrong)[0] != 0)


def step_metrics(generated: Sequence[ScoredGroup], batch: Sequence[ScoredGroup], *,
                 zvp_enabled: bool = False, zvp_wrong: bool = True) -> dict[str, float]:
    """Flat `zve/...` scalars for one step.

    Args:
      generated: every group generated for the step (all refill rounds).
      batch: the groups trained on (a subset of `generated`, same objects).
      zvp_enabled: stage 3 on, so zero-variance groups in the batch still carry signal.
      zvp_wrong: `zve.zvp.wrong_groups`; False: only all-correct zero-variance groups do (an
        all-wrong one keeps a zero advantage, no gradient).

    `zero_variance_frac_before` uses known binary outcomes over the generated groups with one
    (the papers' zero-variance rate); `..._after_tiebreak` shaped rewards over the generated
    groups; `..._after_filter` shaped rewards over the batch; `zero_variance_frac_batch_outcome`
    known binary outcomes over the batch's groups with one. `missing_outcomes` counts the
    generated responses whose reward call failed, `missing_outcome_groups` the groups with no
    known outcome.
    `zv_outcome_rollouts` / `zv_outcome_tokens` are the rollouts and tokens generated in groups
    of one binary outcome. No-signal rollouts and tokens (`espo_jax.zve.accounting`) are those
    of generated groups not trained on, plus those of trained groups without reward contrast
    (unless RL-ZVP gives them one); `trained_zero_adv_tokens` of `trained_tokens` is the latter
    part alone: tokens the update reads whose advantages are all zero (neither counts a response
    whose reward failed: it is not in the loss). `effective_batch` counts trained groups with
    signal.
    """
    batch_ids, generated_ids = {id(g) for g in batch}, {id(g) for g in generated}
    if len(batch_ids) != len(batch) or not batch_ids <= generated_ids:
        raise ValueError("step_metrics: batch must be distinct groups taken from generated")
    rollouts = tokens = no_signal_rollouts = no_signal_tokens = 0
    zv_outcome = zv_reward = zv_rollouts = zv_tokens = missing = no_outcome = 0
    for g in generated:
        lengths, outcomes, known = g.lengths, g.outcomes, known_outcomes(g)
        rollouts += len(outcomes)
        tokens += int(lengths.sum())
        missing += len(outcomes) - len(known)
        no_outcome += not len(known)
        if len(known) and _flat(known):
            zv_outcome += 1
            zv_rollouts += len(outcomes)
            zv_tokens += int(lengths.sum())
        flat = _flat(g.rewards)
        zv_reward += flat
        if id(g) not in batch_ids or (flat and not _zvp_covers(g, zvp_enabled, zvp_wrong)):
            no_signal_rollouts += len(outcomes)
            no_signal_tokens += int(lengths.sum())
    zv_batch = sum(_flat(g.rewards) for g in batch)
    silent = [g for g in batch if _flat(g.rewards) and not _zvp_covers(g, zvp_enabled, zvp_wrong)]
    no_signal = len(silent)
    n_gen = max(len(generated) - no_outcome, 1)
    batch_known = [k for k in map(known_outcomes, batch) if len(k)]
    return {
        "zve/groups_generated": float(len(generated)),
        "zve/rollouts_generated": float(rollouts),
        "zve/tokens_generated": float(tokens),
        "zve/zero_variance_frac_before": zv_outcome / n_gen,
        "zve/zero_variance_frac_after_tiebreak": zv_reward / max(len(generated), 1),
        "zve/zero_variance_frac_after_filter": zv_batch / max(len(batch), 1),
        "zve/zero_variance_frac_batch_outcome": sum(map(_flat, batch_known))
        / max(len(batch_known), 1),
        "zve/zv_outcome_rollouts": float(zv_rollouts),
        "zve/zv_outcome_tokens": float(zv_tokens),
        "zve/trained_tokens": float(sum(map(_trained_tokens, batch))),
        "zve/trained_zero_adv_tokens": float(sum(map(_trained_tokens, silent))),
        "zve/no_signal_rollouts": float(no_signal_rollouts),
        "zve/no_signal_tokens": float(no_signal_tokens),
        "zve/no_signal_token_frac": no_signal_tokens / max(tokens, 1),
        "zve/batch_groups": float(len(batch)),
        "zve/effective_batch": float(len(batch) - no_signal),
        "zve/missing_outcomes": float(missing),
        "zve/missing_outcome_groups": float(no_outcome),
    }


def _trained_tokens(group: ScoredGroup) -> int:
    """The response tokens of `group` that enter the loss (not those whose reward failed)."""
    return int(np.sum(np.where(reward_failed(group), 0, group.lengths)))


def _mean_p90(lengths: Sequence[int]) -> tuple[float, float]:
    if not len(lengths):
        return 0.0, 0.0
    values = np.asarray(lengths, np.float64)
    return float(values.mean()), float(np.percentile(values, 90))


def length_metrics(generated: Sequence[ScoredGroup], batch: Sequence[ScoredGroup],
                   dropped_lengths: Sequence[int] = ()) -> dict[str, float]:
    """`lengths/...` scalars for one step (module docstring): "generated" are the responses
    of `generated` plus `dropped_lengths` (those of groups dropped before MS-ZVE saw them: the
    worker layout's stale groups), "trained" those of `batch` that enter the loss (not the
    responses whose reward failed: their loss mask is 0, `train.advantages.trained_responses`)."""
    made = [int(t) for g in generated for t in g.lengths] + [int(t) for t in dropped_lengths]
    trained = [int(t) for g in batch for t, failed in zip(g.lengths, reward_failed(g),
                                                          strict=True) if not failed]
    (gen_mean, gen_p90), (tr_mean, tr_p90) = _mean_p90(made), _mean_p90(trained)
    return {"lengths/generated_mean": gen_mean, "lengths/generated_p90": gen_p90,
            "lengths/trained_mean": tr_mean, "lengths/trained_p90": tr_p90}
