"""The loss section of an experiment config: every key with its default, each paper's settings
(read from the `espo_jax.rl.losses.LOSSES` registry), and validation that names the key and the
allowed values. The losses themselves, and what each paper uses, are in `espo_jax.rl.losses`."""

import ml_collections

from espo_jax.rl.losses import (
    AGGREGATION_MODES,
    ESPO_TOKEN_RATIOS,
    KL_ESTIMATORS,
    LOSSES,
    unknown_loss,
)
from espo_jax.rl.tis import TIS_MODES

AGGREGATIONS = ("auto", *AGGREGATION_MODES)
_CHOICES = {
    "aggregation": AGGREGATIONS,
    "kl_estimator": KL_ESTIMATORS,
    "tis": TIS_MODES,
    "espo_token_ratio": ESPO_TOKEN_RATIOS,
}


def default_loss_config() -> ml_collections.ConfigDict:
    """Every loss field with its default (the one place defaults are set)."""
    c = ml_collections.ConfigDict()
    c.name = "espo"  # registered loss: grpo | dapo | gspo | gspo_token | espo
    c.clip_low = 0.2  # eps_low: ratio clipped below at 1 - clip_low (not used by espo)
    c.clip_high = 0.2  # eps_high: ratio clipped above at 1 + clip_high (DAPO 0.28; not espo)
    c.aggregation = "auto"  # auto (= LOSSES[name].aggregation) or a mode of `aggregate`
    c.aggregation_norm_len = 0  # L of seq_mean_token_sum_norm (Dr. GRPO budget); 0 = padded T
    c.kl_coef = 0.0  # beta of the KL(pi || pi_ref) penalty; > 0 needs ref_logp
    c.kl_estimator = "k3"  # k1 | k2 | k3 (Schulman's estimators; GRPO uses k3)
    c.kl_clamp = 0.0  # > 0: each token's KL estimate clamped to [-kl_clamp, kl_clamp] (verl: 10)
    # > 1: dual clip (Ye et al. 2020; verl's default c = 3): with A < 0 the objective is bounded
    # below by c * A, so a token whose ratio exceeds c gives no gradient. 0: off.
    c.dual_clip = 0.0
    c.tis = "off"  # truncated IS vs the sampler: off | token | sequence; needs behaviour_logp
    c.tis_cap = 2.0  # C in min(pi_old / pi_sampler, C); TIS suggests 2 or 8
    c.vocab_size = 151936  # |V| in ESPO's log|V| (Qwen3 tokenizer)
    c.espo_high_entropy_frac = 0.2  # share of each response in the high-entropy group; 1.0 = one
    c.espo_alpha = 0.02  # ESPO eps_tau = alpha * mean H_tau / log|V| (paper best 0.02)
    c.espo_token_ratio = "gspo_token"  # gspo_token: sg[s] pi/sg[pi] | as_printed: sg[s] pi/pi_old
    return c


def paper_loss_config(name: str) -> ml_collections.ConfigDict:
    """`default_loss_config()` with the clip settings each paper reports for `name`
    (`LOSSES[name].clip`)."""
    c = default_loss_config()
    if name not in LOSSES:
        raise ValueError(unknown_loss(name))
    c.name = name
    for key, value in LOSSES[name].clip.items():
        c[key] = value
    return c


def validate_loss_config(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError naming the key (and the allowed values) of any bad loss setting."""
    expected = set(default_loss_config().keys())
    given = set(config.keys())
    if expected - given:
        raise ValueError(f"loss config is missing key(s) {sorted(expected - given)}")
    if given - expected:
        raise ValueError(
            f"loss config has unknown key(s) {sorted(given - expected)}; "
            f"valid keys: {sorted(expected)}"
        )
    if config.name not in LOSSES:  # the registry itself: a loss registered later is valid too
        raise ValueError(unknown_loss(config.name))
    for key, allowed in _CHOICES.items():
        if config[key] not in allowed:
            raise ValueError(f"loss config {key}={config[key]!r} is not one of {list(allowed)}")
    paper = LOSSES[config.name].aggregation
    if config.aggregation == "auto" and paper not in AGGREGATION_MODES:
        raise ValueError(
            f"aggregation='auto' means LOSSES[{config.name!r}].aggregation={paper!r}, which is "
            f"not one of {list(AGGREGATION_MODES)}"
        )
    if config.aggregation == "group_mean" and config.name != "espo":
        raise ValueError(f"aggregation='group_mean' needs name='espo', got name={config.name!r}")
    checks = {
        "clip_low": (0.0 <= config.clip_low < 1.0, "in [0, 1)"),
        "clip_high": (config.clip_high >= 0.0, ">= 0"),
        "aggregation_norm_len": (config.aggregation_norm_len >= 0, ">= 0 (0 = padded T)"),
        "kl_coef": (config.kl_coef >= 0.0, ">= 0"),
        "kl_clamp": (config.kl_clamp >= 0.0, ">= 0 (0 = off)"),
        "dual_clip": (config.dual_clip == 0.0 or config.dual_clip > 1.0, "0 (off) or > 1"),
        "tis_cap": (config.tis_cap > 0.0, "> 0"),
        "vocab_size": (config.vocab_size >= 2, ">= 2"),
        "espo_high_entropy_frac": (0.0 < config.espo_high_entropy_frac <= 1.0, "in (0, 1]"),
        "espo_alpha": (config.espo_alpha > 0.0, "> 0"),
    }
    for key, (ok, rule) in checks.items():
        if not ok:
            raise ValueError(f"loss config {key}={config[key]!r} must be {rule}")
