"""Every default of multi-stage zero-variance elimination (MS-ZVE), one line each.

Stages (each switched by its `enabled`; the table in `espo_jax.zve` names their modules):
  0 offline   prune prompts whose pass rate under the starting policy is 0 or 1
  1 adaptive  samples per prompt from the prompt's pass-rate history
  2 tie_break bounded length term inside the correct tier (espo_jax.rewards.shaping)
  3 zvp       RL-ZVP entropy-guided advantages for zero-variance groups (read by the learner)
  4 online_filter  over-sample, drop zero-variance groups, bounded refill
  5 retire    cross-epoch retirement after k equal outcomes in a row, periodic re-probing
All stages off is plain GRPO sampling: every prompt once per epoch with `n_samples` samples.
"""

from __future__ import annotations

import ml_collections

TIE_BREAK_PREFER = ("shorter", "longer")
TIE_BREAK_WRONG = ("zero", "step_credit")


def default_zve_config() -> ml_collections.ConfigDict:
    """MS-ZVE settings with every stage off."""
    c = ml_collections.ConfigDict()
    c.n_samples = 8  # G: samples per prompt (stage 1 off, or a prompt without enough history)

    c.offline = ml_collections.ConfigDict()  # stage 0
    c.offline.enabled = False  # prune by an offline pass-rate estimate (`offline_prune`)
    c.offline.k = 8  # samples per prompt the caller draws for the estimate (`offline_plan`)
    c.offline.low = 0.0  # prune prompts with pass rate <= low (never solved); < 0 keeps them
    c.offline.high = 1.0  # prune prompts with pass rate >= high (always solved)
    c.offline.early_stop = True  # one sample per round; stop a prompt once it cannot be pruned
    c.offline.reprobe_pruned = True  # with stage 5 on, pruned prompts are re-probed too

    c.adaptive = ml_collections.ConfigDict()  # stage 1
    c.adaptive.enabled = False  # choose samples per prompt from its pass-rate history
    c.adaptive.min_samples = 4  # fewest samples for an uncertain prompt
    c.adaptive.max_samples = 16  # most samples for any prompt
    c.adaptive.multiple = 4  # round sample counts up to a multiple (static engine shapes)
    c.adaptive.target_zv = 0.1  # smallest n with P(all n outcomes equal) <= target_zv
    c.adaptive.settled_samples = 0  # samples for a settled prompt (needs > max); 0 skips it
    c.adaptive.prior = 0.5  # Beta(prior, prior) pseudo-counts for the pass-rate estimate
    c.adaptive.decay = 0.7  # history weight kept per visit or skip (old policies count less)
    c.adaptive.min_obs = 4.0  # decayed observations before the estimate is trusted

    c.tie_break = ml_collections.ConfigDict()  # stage 2
    c.tie_break.enabled = False  # break ties inside the correct tier with a length term
    c.tie_break.prefer = "shorter"  # which correct responses rank higher: shorter | longer
    c.tie_break.tier_gap = 1.0  # reward distance between the wrong and the correct tier
    c.tie_break.band = 0.25  # length term lies in (-band, band) * tier_gap; must be < 0.5
    # Score of wrong responses inside the wrong tier: "zero" (all equal), or "step_credit" (the
    # fraction of the worked solution's steps right before the first mistake; arith_chains)
    c.tie_break.wrong_score = "zero"

    c.zvp = ml_collections.ConfigDict()  # stage 3 (applied by the learner's advantages)
    c.zvp.enabled = False  # RL-ZVP advantages (espo_jax.rl.advantages.rl_zvp) for ZV groups
    c.zvp.alpha = 0.1  # scale of the entropy-guided advantage of a zero-variance group
    c.zvp.wrong_groups = True  # all-wrong groups too (the paper); False: only all-correct ones

    c.online_filter = ml_collections.ConfigDict()  # stage 4
    c.online_filter.enabled = False  # drop zero-variance groups (binary outcome) and refill
    c.online_filter.oversample = 1.5  # most groups requested per group still needed
    c.online_filter.max_refill_rounds = 3  # extra generation rounds before giving up
    c.online_filter.pad_with_filtered = True  # on exhaustion top up with dropped groups

    c.retire = ml_collections.ConfigDict()  # stage 5
    c.retire.enabled = False  # retire prompts with a streak of equal outcomes
    c.retire.solved_streak = 3  # visits in a row with every sample right -> retired
    c.retire.failed_streak = 3  # visits in a row with every sample wrong -> retired
    c.retire.reprobe_every = 4  # epochs between re-probes of a retired prompt
    c.retire.reprobe_samples = 4  # samples of a re-probe; a mixed result brings it back
    c.retire.reprobe_frac = 0.05  # re-probes per epoch: at most this times the active prompts
    return c


def validate_zve_config(c: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the field and the numbers when settings cannot work."""
    a, f, r, o = c.adaptive, c.online_filter, c.retire, c.offline
    checks = [
        (c.n_samples >= 1, f"n_samples must be >= 1, got {c.n_samples}"),
        (-1.0 <= o.low < o.high <= 1.0,
         f"offline.low and offline.high need -1 <= low < high <= 1 (low < 0: never prune "
         f"unsolved prompts), got low={o.low}, high={o.high}"),
        (o.k >= 1, f"offline.k must be >= 1, got {o.k}"),
        (1 <= a.min_samples <= a.max_samples,
         f"adaptive.min_samples and adaptive.max_samples need 1 <= min_samples <= max_samples, "
         f"got {a.min_samples}, {a.max_samples}"),
        (a.multiple >= 1, f"adaptive.multiple must be >= 1, got {a.multiple}"),
        (0.0 < a.target_zv < 1.0, f"adaptive.target_zv must be in (0, 1), got {a.target_zv}"),
        (a.settled_samples >= 0, f"adaptive.settled_samples must be >= 0, got "
                                 f"{a.settled_samples}"),
        (a.prior > 0, f"adaptive.prior must be > 0, got {a.prior}"),
        (0.0 < a.decay <= 1.0, f"adaptive.decay must be in (0, 1], got {a.decay}"),
        (a.min_obs >= 0.0, f"adaptive.min_obs must be >= 0, got {a.min_obs}"),
        (c.tie_break.prefer in TIE_BREAK_PREFER,
         f"tie_break.prefer {c.tie_break.prefer!r} is not one of {TIE_BREAK_PREFER}"),
        (c.tie_break.wrong_score in TIE_BREAK_WRONG,
         f"tie_break.wrong_score {c.tie_break.wrong_score!r} is not one of {TIE_BREAK_WRONG}"),
        (0.0 < c.tie_break.band < 0.5, f"tie_break.band must be in (0, 0.5), got "
                                       f"{c.tie_break.band}"),
        (f.oversample >= 1.0, f"online_filter.oversample must be >= 1, got {f.oversample}"),
        (f.max_refill_rounds >= 0, f"online_filter.max_refill_rounds must be >= 0, got "
                                   f"{f.max_refill_rounds}"),
        (r.solved_streak >= 1 and r.failed_streak >= 1,
         f"retire.solved_streak and retire.failed_streak must be >= 1, got "
         f"{r.solved_streak}, {r.failed_streak}"),
        (0.0 <= r.reprobe_frac, f"retire.reprobe_frac must be >= 0, got {r.reprobe_frac}"),
        (r.reprobe_every >= 1, f"retire.reprobe_every must be >= 1, got {r.reprobe_every}"),
        (r.reprobe_samples >= 2, f"retire.reprobe_samples must be >= 2 (one sample cannot show "
                                 f"variance), got {r.reprobe_samples}"),
        (c.tie_break.tier_gap > 0.0, f"tie_break.tier_gap must be > 0, got "
                                     f"{c.tie_break.tier_gap}"),
        (c.zvp.alpha >= 0.0, f"zvp.alpha must be >= 0, got {c.zvp.alpha}"),
    ]
    problems = [message for ok, message in checks if not ok]
    if problems:
        raise ValueError("zve config: " + "; ".join(problems))
