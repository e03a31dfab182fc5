"""MS-ZVE stage 1 (`zve.adaptive`): how many samples a prompt gets, from its pass-rate history.

With p the prompt's pass-rate estimate, a group of n samples is all-equal with probability
p^n + (1-p)^n. The prompt gets the smallest n in [min_samples, max_samples] (rounded up to
`multiple`) with that probability <= target_zv. A prompt for which even max_samples is not
enough is *settled*: it gets `settled_samples` (0 = skipped this epoch). p = (s + prior) /
(t + 2 prior) over decayed counts (s right out of t samples; each visit or skip multiplies the
old counts by `decay`, so a skipped prompt's evidence ages until it is sampled again). Below
`min_obs` decayed samples, n = n_samples.

The counts live in `PromptScheduler` (`succ`, `trials`); these functions are the arithmetic.
"""

from __future__ import annotations

import math

import ml_collections


def zero_variance_prob(p: float, n: int) -> float:
    """P(n Bernoulli(p) outcomes are all equal) = p^n + (1-p)^n."""
    return p**n + (1.0 - p) ** n


def adaptive_samples(p: float, cfg: ml_collections.ConfigDict) -> int:
    """Stage 1 sample count for pass-rate estimate p (`cfg` = the `adaptive` sub-config)."""
    for n in range(cfg.min_samples, cfg.max_samples + 1):
        if zero_variance_prob(p, n) <= cfg.target_zv:
            return min(math.ceil(n / cfg.multiple) * cfg.multiple, cfg.max_samples)
    return cfg.settled_samples


def pass_rate(succ: float, trials: float, cfg: ml_collections.ConfigDict) -> float:
    """The estimate (s + prior) / (t + 2 prior) of decayed counts (`cfg` = `adaptive`)."""
    prior = cfg.prior
    return (succ + prior) / (trials + 2 * prior)


def samples(succ: float, trials: float, config: ml_collections.ConfigDict) -> int:
    """Samples of a normal (not re-probe) visit: `n_samples` with the stage off or too little
    history, else `adaptive_samples` (`config` = the whole zve config)."""
    a = config.adaptive
    if not a.enabled or trials < a.min_obs:
        return config.n_samples
    return adaptive_samples(pass_rate(succ, trials, a), a)


def skipped(succ: float, trials: float, cfg: ml_collections.ConfigDict
            ) -> tuple[float, float]:
    """The counts after a settled prompt is skipped: its evidence ages by `decay`."""
    d = cfg.decay
    return succ * d, trials * d


def observed(succ: float, trials: float, right: int, n: int, cfg: ml_collections.ConfigDict
             ) -> tuple[float, float]:
    """The counts after a visit with `right` of `n` outcomes right (old counts decayed)."""
    d = cfg.decay
    return succ * d + right, trials * d + n
