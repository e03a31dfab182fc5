"""Policy-gradient losses: GRPO, DAPO, GSPO, GSPO-token and ESPO, as pure functions of arrays.

Every loss sees `[B, T]` arrays: `logp` (current policy, differentiable), `old_logp` (policy that
the ratios are taken against; constant), per-token `advantages` (sequence advantages broadcast by
the caller), a 0/1 `mask` of response tokens and, for ESPO, `entropy` of the old policy. A
registered loss returns the per-token clipped surrogate (to maximise) and its ratio and clip
bounds; `policy_loss` then applies truncated importance sampling (`espo_jax.rl.tis`), aggregates,
adds the KL penalty and returns `loss = -objective + kl_coef * KL` with flat metrics
(`espo_jax.rl.token_stats`).

`LOSSES` is the one registry: name -> `LossSpec(fn, aggregation, clip)`, the surrogate with the
reduction and clip settings its paper reports. A new loss is a new function registered there
(`@register(name, aggregation=...)`; from the command line `--config.imports=MODULE`);
the config section (`espo_jax.rl.loss_config`) reads the registry, never the other way round.

Clipped surrogate, written so the gradient at a clip boundary is the unclipped one:
    c(r, A, lo, hi) = clip(r, lo, hi) * A   if (A > 0 and r > hi) or (A < 0 and r < lo)
                      r * A                 otherwise              (= min(r A, clip(r) A))
Sources: GRPO arXiv 2402.03300, DAPO 2503.14476, GSPO 2507.18071, ESPO 2512.00499 (Eq. 5-10).
"""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from espo_jax.rl.aggregation import (  # noqa: F401  (re-exported: losses.aggregate, ...)
    AGGREGATION_MODES,
    aggregate,
    aggregation_weight,
)
from espo_jax.rl.tis import TIS_MODES, tis_weights
from espo_jax.rl.token_stats import masked_quantiles, masked_stats

sg = jax.lax.stop_gradient

# The names `policy_loss` branches on (and `tis.TIS_MODES`).
KL_ESTIMATORS = ("k1", "k2", "k3")
ESPO_TOKEN_RATIOS = ("gspo_token", "as_printed")


class Surrogate(NamedTuple):
    """What a registered loss returns (all `[B, T]`, zero or neutral at masked positions)."""

    objective: jax.Array  # clipped surrogate per token, to maximise
    ratio: jax.Array  # importance ratio fed to the clip (its value), for metrics
    lower: jax.Array  # lower clip bound 1 - eps_low per token
    upper: jax.Array  # upper clip bound 1 + eps_high per token
    group_weights: jax.Array | None  # ESPO Eq. 5 weights 1 / (|groups| |y_tau|), else None
    metrics: dict[str, jax.Array]


def _clipped(ratio, adv, lower, upper):
    binds = ((adv > 0) & (ratio > upper)) | ((adv < 0) & (ratio < lower))
    return jnp.where(binds, jnp.clip(ratio, lower, upper) * adv, ratio * adv)


def _masked_log_ratio(logp, old_logp, mask):
    """log(pi / pi_old) per token; exactly 0 at masked positions (whatever they hold)."""
    return jnp.where(mask > 0, logp - sg(old_logp), 0.0)


def _token_clip(logp, old_logp, advantages, mask, config) -> Surrogate:
    ratio = jnp.exp(_masked_log_ratio(logp, old_logp, mask))
    lower = jnp.full_like(ratio, 1.0 - config.clip_low)
    upper = jnp.full_like(ratio, 1.0 + config.clip_high)
    obj = _clipped(ratio, advantages, lower, upper) * mask
    return Surrogate(obj, ratio, lower, upper, None, {})


def grpo(logp, old_logp, advantages, mask, config, *, entropy=None) -> Surrogate:
    """GRPO / PPO token clip: r_t = pi(y_t) / pi_old(y_t);  J_t = c(r_t, A_t, 1-eps_lo, 1+eps_hi).

    Paper aggregation: 1/G sum_i 1/|y_i| sum_t J_t (`seq_mean_token_mean`). eps = `clip_low`,
    `clip_high`.
    """
    del entropy
    return _token_clip(logp, old_logp, advantages, mask, config)


def dapo(logp, old_logp, advantages, mask, config, *, entropy=None) -> Surrogate:
    """DAPO: the token clip of `grpo` with decoupled eps (clip-higher, paper 0.2 / 0.28).

    J = sum_{i,t} J_t / sum_i |y_i| (`token_mean`: every token of the batch weighs the same).
    Dynamic sampling and the soft overlong penalty live in the data path and `advantages`.
    """
    del entropy
    return _token_clip(logp, old_logp, advantages, mask, config)


def _seq_log_ratio(logp, old_logp, mask):
    """mean_t log(pi/pi_old) over each response's valid tokens, `[B, 1]`; 0 for empty rows."""
    n = jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    return _masked_log_ratio(logp, old_logp, mask).sum(axis=1, keepdims=True) / n


def gspo(logp, old_logp, advantages, mask, config, *, entropy=None) -> Surrogate:
    """GSPO: s_i = exp(1/|y_i| sum_t log(pi/pi_old));  J_t = c(s_i, A_t, 1-eps_lo, 1+eps_hi).

    The sequence ratio (geometric mean of token ratios) carries the gradient; with a sequence
    advantage broadcast over tokens and `seq_mean_token_mean` this is GSPO's
    1/G sum_i min(s_i A_i, clip(s_i) A_i). Paper eps: 3e-4 / 4e-4.
    """
    del entropy
    s = jnp.broadcast_to(jnp.exp(_seq_log_ratio(logp, old_logp, mask)), logp.shape)
    lower = jnp.full_like(s, 1.0 - config.clip_low)
    upper = jnp.full_like(s, 1.0 + config.clip_high)
    return Surrogate(_clipped(s, advantages, lower, upper) * mask, s, lower, upper, None, {})


def _detached_token_factor(logp, mask):
    """pi(y_t) / sg[pi(y_t)]: value 1, gradient d log pi(y_t)."""
    return jnp.exp(jnp.where(mask > 0, logp - sg(logp), 0.0))


def gspo_token(logp, old_logp, advantages, mask, config, *, entropy=None) -> Surrogate:
    """GSPO-token: s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)];  J_t = c(s_{i,t}, A_t, ...).

    Same value as GSPO, but each token's gradient is its own d log pi(y_t), so per-token
    advantages (e.g. RL-ZVP) act token by token. Paper aggregation `seq_mean_token_mean`.
    """
    del entropy
    s_seq = jnp.exp(_seq_log_ratio(logp, old_logp, mask))
    s = sg(s_seq) * _detached_token_factor(logp, mask)
    lower = jnp.full_like(s, 1.0 - config.clip_low)
    upper = jnp.full_like(s, 1.0 + config.clip_high)
    return Surrogate(_clipped(s, advantages, lower, upper) * mask, s, lower, upper, None, {})


def espo_clip_eps(mean_entropy, alpha: float, vocab_size: int):
    """ESPO clip range of an entropy group: eps_tau = alpha * mean_{t in tau} H_t / log|V|."""
    return alpha * mean_entropy / math.log(vocab_size)


def espo_entropy_groups(entropy_BxT: jax.Array, mask_BxT: jax.Array, frac: float) -> jax.Array:
    """Bool `[B, T]`: the ceil(frac * |y_i|) highest-entropy valid tokens of each response.

    Ties keep the earlier position. frac=1.0 selects every valid token (one group).
    """
    valid = mask_BxT > 0
    n = valid.sum(axis=1).astype(jnp.float32)
    k = jnp.clip(jnp.ceil(frac * n), jnp.minimum(n, 1.0), n)
    keyed = jnp.where(valid, sg(entropy_BxT), -jnp.inf)
    order = jnp.argsort(-keyed, axis=1, stable=True)
    rank = jnp.argsort(order, axis=1, stable=True)
    return valid & (rank < k[:, None])


def espo(logp, old_logp, advantages, mask, config, *, entropy=None) -> Surrogate:
    """ESPO: entropy-grouped sequence ratios with entropy-scaled clip ranges.

    Tokens of response i split into tau_hi (ceil(`espo_high_entropy_frac` * |y_i|) highest old-
    policy entropies) and tau_lo (the rest; empty groups are dropped). Per group tau:
      s_tau     = exp(1/|tau| sum_{t in tau} log(pi/pi_old))        (geometric-mean ratio)
      s_tau,t   = sg[s_tau] * pi(y_t) / sg[pi(y_t)]                  (`gspo_token`, default)
                = sg[s_tau] * pi(y_t) / pi_old(y_t)                  (`as_printed` in the paper)
      eps_tau   = `espo_alpha` * mean_{t in tau} H_t / log(`vocab_size`)   (symmetric)
      J_t       = c(s_tau,t, A_t, 1 - eps_tau, 1 + eps_tau)
    Paper aggregation (`group_mean`, Eq. 5): 1/G sum_i 1/|groups_i| sum_tau 1/|tau| sum_t J_t.
    The printed form multiplies the group ratio by the token ratio, so its value is
    s_tau * r_t rather than s_tau; both are 1 on-policy. frac=1.0 gives GSPO-token with
    eps = alpha * mean H / log V; one token per group gives a token PPO clip with eps_t.
    """
    if entropy is None:
        raise ValueError("loss 'espo' needs entropy [B, T] (token entropies of the old policy)")
    ent = sg(entropy.astype(logp.dtype))
    valid = mask > 0
    high = espo_entropy_groups(ent, mask, config.espo_high_entropy_frac)
    low = valid & ~high
    log_ratio = _masked_log_ratio(logp, old_logp, mask)

    def group_stats(member):
        m = member.astype(log_ratio.dtype)
        count = m.sum(axis=1, keepdims=True)
        denom = jnp.maximum(count, 1.0)
        s = jnp.exp((log_ratio * m).sum(axis=1, keepdims=True) / denom)
        eps = espo_clip_eps(
            (ent * m).sum(axis=1, keepdims=True) / denom, config.espo_alpha, config.vocab_size
        )
        return count, s, eps

    n_hi, s_hi, eps_hi = group_stats(high)
    n_lo, s_lo, eps_lo = group_stats(low)
    s_group = jnp.where(high, s_hi, s_lo)
    eps = jnp.where(high, eps_hi, eps_lo)
    if config.espo_token_ratio == "gspo_token":
        token_factor = _detached_token_factor(logp, mask)
    else:  # "as_printed": pi / sg[pi_old]
        token_factor = jnp.exp(log_ratio)
    ratio = sg(s_group) * token_factor
    lower, upper = 1.0 - eps, 1.0 + eps
    obj = _clipped(ratio, advantages, lower, upper) * mask

    n_groups = (n_hi > 0).astype(jnp.float32) + (n_lo > 0).astype(jnp.float32)
    group_size = jnp.where(high, n_hi, n_lo)
    weights = jnp.where(valid, 1.0 / jnp.maximum(group_size * n_groups, 1.0), 0.0)

    rows = jnp.maximum((n_groups > 0).sum(), 1.0)
    groups_total = jnp.maximum(n_groups.sum(), 1.0)
    metrics = {
        "espo/group_size_high": n_hi.sum() / rows,
        "espo/group_size_low": n_lo.sum() / rows,
        "espo/eps_mean": ((eps_hi * (n_hi > 0)).sum() + (eps_lo * (n_lo > 0)).sum()) / groups_total,
        "espo/eps_high": (eps_hi * (n_hi > 0)).sum() / jnp.maximum((n_hi > 0).sum(), 1.0),
        "espo/eps_low": (eps_lo * (n_lo > 0)).sum() / jnp.maximum((n_lo > 0).sum(), 1.0),
    }
    return Surrogate(obj, ratio, lower, upper, weights, metrics)


LossFn = Callable[..., Surrogate]


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A registered loss: its surrogate and the settings its paper reports."""

    fn: LossFn  # (logp, old_logp, advantages, mask, config, *, entropy) -> Surrogate
    aggregation: str  # what `aggregation="auto"` means: the paper's mode of `aggregate`
    clip: Mapping[str, float] = dataclasses.field(default_factory=dict)  # paper clip_low/high
    # ({}: the config defaults, 0.2 / 0.2)


_GSPO_CLIP = {"clip_low": 3e-4, "clip_high": 4e-4}
LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec(grpo, "seq_mean_token_mean"),
    "dapo": LossSpec(dapo, "token_mean", {"clip_low": 0.2, "clip_high": 0.28}),
    "gspo": LossSpec(gspo, "seq_mean_token_mean", _GSPO_CLIP),
    "gspo_token": LossSpec(gspo_token, "seq_mean_token_mean", _GSPO_CLIP),
    "espo": LossSpec(espo, "group_mean"),  # clip ranges come from entropies, not clip_low/high
}


def register(name: str, *, aggregation: str, clip: Mapping[str, float] | None = None):
    """Decorator: `@register("reinforce", aggregation="token_mean")` adds the decorated loss to
    `LOSSES` (`LossSpec(fn, aggregation, clip)`). Put it in a module of your own and name that
    module with `--config.imports=MODULE` (`experiments/my_loss.py`). Registering a name taken
    by another function is an error; the same function again (a re-import) is not."""

    def decorator(fn: LossFn) -> LossFn:
        old = LOSSES.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (
                fn.__module__, fn.__qualname__):
            raise ValueError(f"loss {name!r} is already registered "
                             f"({old.fn.__module__}.{old.fn.__qualname__}); choose another name")
        LOSSES[name] = LossSpec(fn, aggregation, dict(clip or {}))
        return fn

    return decorator


def unknown_loss(name: str) -> str:
    """The error for a loss name not in `LOSSES`: the registered names and how to add one."""
    return (f"loss {name!r} is not registered; registered: {sorted(LOSSES)}. Register your own "
            "with the decorator `@espo_jax.rl.losses.register(NAME, aggregation=...)` in a "
            "module of your own, and import that module with --config.imports=MODULE "
            "(example: --config.imports=my_loss --config.loss.name=reinforce, "
            "experiments/my_loss.py)")


def aggregation_mode(config: ml_collections.ConfigDict) -> str:
    """The `aggregate` mode a loss config uses (`auto` resolves to the paper's)."""
    return LOSSES[config.name].aggregation if config.aggregation == "auto" else config.aggregation


def _kl(logp, ref_logp, mask, estimator):
    """KL(pi || ref) per token from samples of pi: k1 = -d, k2 = d^2/2, k3 = e^d - d - 1."""
    d = jnp.where(mask > 0, sg(ref_logp) - logp, 0.0)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return jnp.exp(d) - d - 1.0


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: ml_collections.ConfigDict,
    *,
    entropy: jax.Array | None = None,
    behaviour_logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss to minimise for `config.name`, and flat metrics. All arrays `[B, T]`.

    loss = -Agg_t( w_t * J_t ) + kl_coef * Agg_t( KL_t )
      J_t  the registered surrogate (see LOSSES), with `dual_clip` c > 1: max(J_t, c A_t) where
           A_t < 0; Agg per `config.aggregation` (`auto` = paper);
      w_t  TIS weight min(pi_old / pi_behaviour, tis_cap) per token or sequence (1 if `off`);
      KL_t k1/k2/k3 estimate of KL(pi || pi_ref) on the sampled tokens (clamped to
           [-kl_clamp, kl_clamp] when `kl_clamp` > 0).
    `entropy` (old policy, constant) is needed by ESPO; `behaviour_logp` (the sampler's
    log-probs) by TIS; `ref_logp` by `kl_coef > 0`. Config values are static: wrap with
    `functools.partial(policy_loss, config=cfg)` before `jax.jit`. The names it branches on are
    checked here; ranges and keys by `loss_config.validate_loss_config`
    (`config_validation.validate`).
    """
    if config.name not in LOSSES:
        raise ValueError(unknown_loss(config.name))
    for key, allowed in (("kl_estimator", KL_ESTIMATORS), ("tis", TIS_MODES),
                         ("espo_token_ratio", ESPO_TOKEN_RATIOS)):
        if config[key] not in allowed:  # the rest: `loss_config.validate_loss_config`
            raise ValueError(f"loss config {key}={config[key]!r} is not one of {list(allowed)}")
    shape = jnp.shape(logp)
    named = {
        "old_logp": old_logp,
        "advantages": advantages,
        "mask": mask,
        "entropy": entropy,
        "behaviour_logp": behaviour_logp,
        "ref_logp": ref_logp,
    }
    if len(shape) != 2:
        raise ValueError(f"logp must be [B, T], got shape {shape}")
    for key, value in named.items():
        if value is not None and jnp.shape(value) != shape:
            raise ValueError(f"{key} has shape {jnp.shape(value)}, expected logp's {shape}")
    if config.tis != "off" and behaviour_logp is None:
        raise ValueError(f"tis={config.tis!r} needs behaviour_logp (the sampler's log-probs)")
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={config.kl_coef} > 0 needs ref_logp")

    dtype = jnp.promote_types(jnp.result_type(logp), jnp.float32)  # bf16 -> f32; f64 stays
    m = mask.astype(dtype)
    logp = logp.astype(dtype)
    old_logp = old_logp.astype(dtype)
    adv = jnp.where(m > 0, sg(advantages.astype(dtype)), 0.0)
    sur = LOSSES[config.name].fn(logp, old_logp, adv, m, config, entropy=entropy)
    mode = aggregation_mode(config)

    def agg(x):
        return aggregate(
            x, m, mode, norm_len=config.aggregation_norm_len, group_weights=sur.group_weights
        )

    metrics = dict(sur.metrics)
    objective = sur.objective
    if config.dual_clip > 0:
        # With A < 0 the clipped surrogate -> -inf as the ratio grows; c * A bounds it, and the
        # bound's gradient is zero (verl's `clip_ratio_c`).
        floor = config.dual_clip * adv * m
        bound = (adv < 0) & (objective < floor)
        objective = jnp.where(bound, floor, objective)
        metrics["pg/dual_clip_frac"] = (bound * m).sum() / jnp.maximum(m.sum(), 1.0)
    if behaviour_logp is not None:
        level = "sequence" if config.tis == "sequence" else "token"
        weights, tis_stats = tis_weights(old_logp, behaviour_logp, m, level, config.tis_cap)
        metrics.update(tis_stats)
        if config.tis != "off":
            objective = objective * weights
    pg_loss = -agg(objective)
    loss = pg_loss
    if ref_logp is not None:
        kl = _kl(logp, ref_logp.astype(dtype), m, config.kl_estimator)
        if config.kl_clamp > 0:
            kl = jnp.clip(kl, -config.kl_clamp, config.kl_clamp)
        kl_agg = agg(kl)
        metrics["kl/mean"] = kl_agg
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl_agg
    n_tok = jnp.maximum(m.sum(), 1.0)
    r = sur.ratio
    log_r = _masked_log_ratio(logp, old_logp, m)
    metrics.update(masked_stats(r, m, "is_ratio/"))
    metrics.update(masked_quantiles(r, m, "is_ratio/", (0.01, 0.05, 0.95, 0.99)))
    metrics.update(
        {
            "pg/clipfrac_low": (((adv < 0) & (r < sur.lower)) * m).sum() / n_tok,
            "pg/clipfrac_high": (((adv > 0) & (r > sur.upper)) * m).sum() / n_tok,
            # KL(pi_old || pi) from samples of pi_old, k3: E[(pi/pi_old) - 1 - log(pi/pi_old)].
            "pg/approx_kl": ((jnp.exp(log_r) - 1.0 - log_r) * m).sum() / n_tok,
            "pg/loss": pg_loss,
            "pg/num_tokens": m.sum(),
            "loss/total": loss,
        }
    )
    return loss, jax.tree.map(sg, metrics)
