"""Hand-computed values of every loss and aggregation mode, metrics, config validation, jit."""

import ast
import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.rl import loss_config, losses

# Two responses, T = 4. Row 0 has 3 tokens with ratios 0.7, 1.1, 1.3 and A = +1; row 1 has
# 2 tokens with ratios 0.7, 1.1 and A = -1. Masked positions hold garbage that must not matter.
RATIOS = np.array([[0.7, 1.1, 1.3, 1.0], [0.7, 1.1, 1.0, 1.0]])
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
ADV = np.array([[1.0] * 4, [-1.0] * 4], np.float32)
OLD = np.array([[-1.0, -2.0, -0.5, 3.0], [-1.5, -0.2, 7.0, -9.0]], np.float32)
LOGP = np.where(MASK > 0, OLD + np.log(RATIOS), 123.0).astype(np.float32)


def _cfg(name, **overrides):
    cfg = loss_config.default_loss_config()
    cfg.name = name
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


@pytest.fixture(name="loss")
def _loss_fixture(run_loss):
    def loss(cfg, logp=LOGP, **kw):
        """(loss, metrics, grad) on the two-row batch above, jitted."""
        return run_loss(cfg, jnp.asarray(logp), OLD, ADV, MASK, **kw)

    return loss


def test_aggregation_modes_by_hand():
    # Valid values: row 0 -> 1, 2, 3; row 1 -> 4; row 2 empty. Garbage 99 at masked positions.
    x = jnp.array([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0] * 4])
    m = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    agg = functools.partial(losses.aggregate, x, m)
    assert agg("token_mean") == pytest.approx(10.0 / 4)  # (1+2+3+4) / 4 tokens
    assert agg("seq_mean_token_mean") == pytest.approx(3.0)  # (6/3 + 4/1) / 2 non-empty rows
    assert agg("seq_mean_token_sum") == pytest.approx(5.0)  # (6 + 4) / 2
    assert agg("seq_mean_token_sum_norm") == pytest.approx(1.25)  # (6/4 + 4/4) / 2, L = T = 4
    assert agg("seq_mean_token_sum_norm", norm_len=10) == pytest.approx(0.5)  # (0.6 + 0.4) / 2
    # group_mean with weights 1/(|groups| |tau|): row 0 groups {1} and {2, 3}: w = 1/2, 1/4, 1/4
    w = jnp.array([[0.5, 0.25, 0.25, 0.0], [1.0, 0, 0, 0], [0.0] * 4])
    # row 0: 0.5*1 + 0.25*2 + 0.25*3 = 1.75; row 1: 4; mean = 2.875
    assert agg("group_mean", group_weights=w) == pytest.approx(2.875)
    with pytest.raises(ValueError, match="group_mean"):
        agg("group_mean")


def test_grpo_by_hand(loss):
    loss, met, g = loss(_cfg("grpo"))
    # eps 0.2/0.2. Row 0 (A=+1): 0.7 -> 0.7, 1.1 -> 1.1, 1.3 > 1.2 clipped -> 1.2; mean 1.0.
    # Row 1 (A=-1): 0.7 < 0.8 clipped -> -0.8, 1.1 -> -1.1; mean -0.95. seq mean: 0.025.
    assert loss == pytest.approx(-0.025, abs=1e-6)
    assert met["pg/clipfrac_high"] == pytest.approx(1 / 5)  # 1.3 with A > 0
    assert met["pg/clipfrac_low"] == pytest.approx(1 / 5)  # 0.7 with A < 0 (row 0's 0.7 has A>0)
    assert met["is_ratio/mean"] == pytest.approx((0.7 + 1.1 + 1.3 + 0.7 + 1.1) / 5, rel=1e-6)
    assert met["is_ratio/min"] == pytest.approx(0.7, rel=1e-6)
    assert met["is_ratio/max"] == pytest.approx(1.3, rel=1e-6)
    # Tails over the 5 valid ratios 0.7 0.7 1.1 1.1 1.3 (linear interpolation, numpy's rule):
    # p05 at rank 0.2 -> 0.7; p95 at rank 3.8 -> 1.1 + 0.8 * 0.2 = 1.26.
    assert met["is_ratio/p05"] == pytest.approx(0.7, rel=1e-5)
    assert met["is_ratio/p95"] == pytest.approx(1.26, rel=1e-5)
    assert met["is_ratio/p01"] == pytest.approx(0.7, rel=1e-5)
    k3 = [r - 1 - math.log(r) for r in (0.7, 1.1, 1.3, 0.7, 1.1)]
    assert met["pg/approx_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert met["pg/num_tokens"] == 5
    assert met["loss/total"] == pytest.approx(float(loss))
    # d loss / d logp_t = -w_t A_t r_t unless clipped: w = 1/(2*3) in row 0, 1/(2*2) in row 1.
    want = [[-0.7 / 6, -1.1 / 6, 0, 0], [0, 1.1 / 4, 0, 0]]
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_dapo_by_hand(loss):
    fn = loss
    loss, met, _ = fn(_cfg("dapo", clip_high=0.28))
    # 1.3 > 1.28 clipped -> 1.28. Token mean over 5 tokens:
    # (0.7 + 1.1 + 1.28 - 0.8 - 1.1) / 5 = 1.18 / 5 = 0.236.
    assert loss == pytest.approx(-0.236, abs=1e-6)
    assert met["pg/clipfrac_high"] == pytest.approx(1 / 5)
    # Same surrogate with aggregation overridden to seq_mean_token_mean:
    # row 0 (0.7 + 1.1 + 1.28)/3 = 1.02667, row 1 -0.95 -> 0.038333.
    loss2, _, _ = fn(_cfg("dapo", clip_high=0.28, aggregation="seq_mean_token_mean"))
    assert loss2 == pytest.approx(-(3.08 / 3 - 0.95) / 2, abs=1e-6)
    # seq_mean_token_sum: (3.08 - 1.9) / 2 = 0.59; _norm with L=4: 0.59 / 4
    loss3, _, _ = fn(_cfg("dapo", clip_high=0.28, aggregation="seq_mean_token_sum"))
    assert loss3 == pytest.approx(-0.59, abs=1e-6)
    loss4, _, _ = fn(_cfg("dapo", clip_high=0.28, aggregation="seq_mean_token_sum_norm"))
    assert loss4 == pytest.approx(-0.59 / 4, abs=1e-6)


# Three rows for the sequence-level losses: ratios (0.5, 2) -> s = 1; (e^.3, e^.1) -> s = e^.2;
# (e^.4, e^.2) -> s = e^.3.
SEQ_LR = np.array([[math.log(0.5), math.log(2.0)], [0.3, 0.1], [0.4, 0.2]], np.float32)
SEQ_OLD = np.full((3, 2), -1.0, np.float32)
SEQ_MASK = np.ones((3, 2), np.float32)
SEQ_ADV = np.array([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0]], np.float32)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_by_hand(name, run_loss):
    cfg = _cfg(name)  # eps 0.2 / 0.2 to keep the numbers readable
    logp = jnp.asarray(SEQ_OLD + SEQ_LR)
    loss, met, g = run_loss(cfg, logp, SEQ_OLD, SEQ_ADV, SEQ_MASK)
    # Row 0: s = 1, A = 1 -> 1. Row 1: s = e^.2 = 1.2214 > 0.8, A = -1 -> -1.2214 (unclipped).
    # Row 2: s = e^.3 = 1.3499 > 1.2, A = +1 -> clipped 1.2. Mean = (1 - 1.2214 + 1.2) / 3.
    assert loss == pytest.approx(-(1 - math.exp(0.2) + 1.2) / 3, abs=1e-6)
    assert met["pg/clipfrac_high"] == pytest.approx(2 / 6)  # both tokens of row 2
    assert met["is_ratio/max"] == pytest.approx(math.exp(0.3), rel=1e-6)
    # d/dlogp_t of s*A with ds/dlogp_t = s/|y| = s/2, row weight 1/3: row 0 -> -1/6 each,
    # row 1 -> +e^.2/6 each, row 2 clipped -> 0.
    e2 = math.exp(0.2) / 6
    np.testing.assert_allclose(g, [[-1 / 6, -1 / 6], [e2, e2], [0, 0]], rtol=1e-5)
    # Per-token advantages (1, 3) on row 0 (s = 1): GSPO's gradient is mean(A) / |y| * s for each
    # token, (1+3)/2 / 2 = 1, weight 1/3; GSPO-token's is A_t * s / |y|: 0.5 and 1.5, weight 1/3.
    adv = SEQ_ADV.copy()
    adv[0] = [1.0, 3.0]
    _, _, g = run_loss(cfg, logp, SEQ_OLD, adv, SEQ_MASK)
    want = [-1 / 3, -1 / 3] if name == "gspo" else [-0.5 / 3, -1.5 / 3]
    np.testing.assert_allclose(g[0], want, rtol=1e-5)


# ESPO: one response of 5 tokens, entropies (0.1, 2.0, 0.3, 0.2, 0.5), frac 0.2 -> ceil(1) = 1
# high token (t=1); low group t = 0, 2, 3, 4 with mean H = 1.1 / 4 = 0.275. alpha = 0.1 log V so
# eps = 0.1 * H: eps_hi = 0.2, eps_lo = 0.0275. Log ratios: high 0.3; low (0, .02, .04, -.02),
# mean 0.01, so s_hi = e^.3 = 1.3499, s_lo = e^.01 = 1.01005. A = +1.
ESPO_H = np.array([[0.1, 2.0, 0.3, 0.2, 0.5]], np.float32)
ESPO_LR = np.array([[0.0, 0.3, 0.02, 0.04, -0.02]], np.float32)
ESPO_OLD = np.full((1, 5), -2.0, np.float32)


def _espo_cfg(**kw):
    return _cfg("espo", vocab_size=100, espo_alpha=0.1 * math.log(100), **kw)


def _espo(run_loss, cfg):
    ones = np.ones((1, 5), np.float32)
    logp = jnp.asarray(ESPO_OLD + ESPO_LR)
    return run_loss(cfg, logp, ESPO_OLD, ones, ones, entropy=jnp.asarray(ESPO_H))


def test_espo_by_hand(run_loss):
    loss, met, g = _espo(run_loss, _espo_cfg())
    # High group: s = 1.3499 > 1 + 0.2 -> clipped 1.2. Low group: 1.01005 < 1.0275 -> 1.01005
    # per token, group mean 1.01005. Eq. 5: (1.2 + 1.01005) / 2 groups = 1.105025.
    assert loss == pytest.approx(-(1.2 + math.exp(0.01)) / 2, abs=1e-6)
    assert met["espo/group_size_high"] == 1 and met["espo/group_size_low"] == 4
    assert met["espo/eps_high"] == pytest.approx(0.2, rel=1e-5)
    assert met["espo/eps_low"] == pytest.approx(0.0275, rel=1e-5)
    assert met["espo/eps_mean"] == pytest.approx((0.2 + 0.0275) / 2, rel=1e-5)
    assert met["pg/clipfrac_high"] == pytest.approx(1 / 5)
    # Gradient: high token clipped -> 0; low tokens w s_lo A with w = 1/(2 groups * 4 tokens).
    lo = -math.exp(0.01) / 8
    np.testing.assert_allclose(g, [[lo, 0.0, lo, lo, lo]], rtol=1e-5)


def test_espo_as_printed_by_hand(run_loss):
    loss, _, _ = _espo(run_loss, _espo_cfg(espo_token_ratio="as_printed"))
    # Ratio = s_tau * r_t. High: e^.3 * e^.3 = e^.6 > 1.2 -> 1.2. Low: e^.01 * (e^0, e^.02,
    # e^.04, e^-.02) = e^.01, e^.03 = 1.03045 -> clip 1.0275, e^.05 -> clip 1.0275, e^-.01.
    low = (math.exp(0.01) + 1.0275 + 1.0275 + math.exp(-0.01)) / 4
    assert loss == pytest.approx(-(1.2 + low) / 2, abs=1e-6)


def test_espo_groups_ties_and_fractions():
    h = jnp.array([[1.0, 1.0, 1.0, 1.0, 9.0], [0.3, 0.9, 0.1, 0.5, 0.7]])
    m = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # Row 0: 4 valid, frac 0.5 -> 2 high; equal entropies keep the earlier positions; the masked
    # 9.0 is never chosen. Row 1: 5 valid -> ceil(2.5) = 3 highest: 0.9, 0.7, 0.5.
    got = losses.espo_entropy_groups(h, m, 0.5)
    np.testing.assert_array_equal(got, [[1, 1, 0, 0, 0], [0, 1, 0, 1, 1]])
    np.testing.assert_array_equal(losses.espo_entropy_groups(h, m, 1.0), m > 0)
    # frac 0.2 on 4 tokens: ceil(0.8) = 1.
    assert int(losses.espo_entropy_groups(h, m, 0.2)[0].sum()) == 1


def test_espo_clip_eps_formula():
    # 0.02 * 1.5 / log(151936) = 0.03 / 11.9311 = 0.0025144
    assert losses.espo_clip_eps(1.5, 0.02, 151936) == pytest.approx(0.03 / math.log(151936))


def test_kl_estimators_by_hand(run_loss):
    # One token, logp = -1, ref = -1.5: d = ref - logp = -0.5.
    one = np.ones((1, 1), np.float32)
    logp, ref = jnp.full((1, 1), -1.0), jnp.full((1, 1), -1.5)
    want = {"k1": 0.5, "k2": 0.125, "k3": math.exp(-0.5) + 0.5 - 1}  # -d, d^2/2, e^d - d - 1
    for est, kl in want.items():
        cfg = _cfg("grpo", kl_coef=0.1, kl_estimator=est)
        loss, met, _ = run_loss(cfg, logp, logp, 0 * one, one, ref_logp=ref)
        assert met["kl/mean"] == pytest.approx(kl, rel=1e-5)
        assert loss == pytest.approx(0.1 * kl, rel=1e-5)  # A = 0: only the penalty remains


def test_tis_by_hand(run_loss):
    # Two tokens, ratio 1, A = 1. old - behaviour log ratios: log 3 and log 0.5; cap C = 2.
    one = np.ones((1, 2), np.float32)
    old = jnp.array([[-1.0, -2.0]])
    beh = old - jnp.array([[math.log(3.0), math.log(0.5)]])
    cfg = _cfg("grpo", tis="token", tis_cap=2.0)
    loss, met, _ = run_loss(cfg, old, old, one, one, behaviour_logp=beh)
    # Token weights min(3, 2) = 2 and 0.5: objective (2*1 + 0.5*1) / 2 = 1.25.
    assert loss == pytest.approx(-1.25, rel=1e-6)
    assert met["tis/weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert met["tis/weight_min"] == pytest.approx(0.5, rel=1e-5)
    assert met["tis/truncated_frac"] == pytest.approx(0.5)
    # Sequence level: weight min(3 * 0.5, 2) = 1.5 on both tokens -> objective 1.5.
    cfg.tis = "sequence"
    loss, met, _ = run_loss(cfg, old, old, one, one, behaviour_logp=beh)
    assert loss == pytest.approx(-1.5, rel=1e-6)
    assert met["tis/truncated_frac"] == 0
    # tis off: weights reported, not applied.
    cfg.tis = "off"
    loss, met, _ = run_loss(cfg, old, old, one, one, behaviour_logp=beh)
    assert loss == pytest.approx(-1.0) and met["tis/weight_max"] == pytest.approx(3.0, rel=1e-5)


def test_metric_names_are_flat_namespaced_scalars(loss):
    cfg = _cfg("espo", tis="token", kl_coef=0.01)
    ent = jnp.ones_like(LOGP)
    _, met, _ = loss(cfg, entropy=ent, behaviour_logp=OLD, ref_logp=OLD)
    need = {
        "pg/clipfrac_low",
        "pg/clipfrac_high",
        "is_ratio/mean",
        "is_ratio/min",
        "is_ratio/max",
        "pg/approx_kl",
        "espo/group_size_high",
        "espo/eps_mean",
        "tis/weight_max",
        "tis/truncated_frac",
        "kl/mean",
        "loss/total",
        "pg/loss",
    }
    assert need <= set(met)
    for key, value in met.items():
        assert key.count("/") == 1 and jnp.shape(value) == (), key


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("name", "ppo", r"loss 'ppo' is not registered; registered: \['dapo', 'espo'"),
        ("aggregation", "mean", "aggregation='mean'"),
        ("kl_estimator", "k4", "kl_estimator"),
        ("tis", "tokens", r"\['off', 'token', 'sequence'\]"),
        ("espo_token_ratio", "pi_old", "espo_token_ratio"),
        ("espo_high_entropy_frac", 0.0, "espo_high_entropy_frac"),
        ("espo_alpha", -1.0, "espo_alpha"),
        ("clip_low", 1.0, "clip_low"),
        ("vocab_size", 1, "vocab_size"),
        ("tis_cap", 0.0, "tis_cap"),
        ("dual_clip", 0.5, "dual_clip=0.5 must be 0 .off. or > 1"),
        ("kl_clamp", -1.0, "kl_clamp"),
        ("aggregation", "group_mean", "group_mean.*needs name='espo'"),
    ],
)
def test_validate_loss_config_names_the_key(key, value, match):
    cfg = _cfg("grpo")
    cfg[key] = value
    with pytest.raises(ValueError, match=match):
        loss_config.validate_loss_config(cfg)


def test_validate_rejects_unknown_and_missing_keys():
    cfg = loss_config.default_loss_config()
    cfg.unlock()
    cfg.espo_alfa = 0.1
    with pytest.raises(ValueError, match="espo_alfa"):
        loss_config.validate_loss_config(cfg)
    del cfg["espo_alfa"], cfg["tis_cap"]
    with pytest.raises(ValueError, match="missing.*tis_cap"):
        loss_config.validate_loss_config(cfg)


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match="needs entropy"):
        losses.policy_loss(LOGP, OLD, ADV, MASK, _cfg("espo"))
    with pytest.raises(ValueError, match="behaviour_logp"):
        losses.policy_loss(LOGP, OLD, ADV, MASK, _cfg("grpo", tis="token"))
    with pytest.raises(ValueError, match="ref_logp"):
        losses.policy_loss(LOGP, OLD, ADV, MASK, _cfg("grpo", kl_coef=0.1))
    with pytest.raises(ValueError, match="advantages has shape"):
        losses.policy_loss(LOGP, OLD, ADV[:, :2], MASK, _cfg("grpo"))


def test_policy_loss_rejects_names_it_would_branch_on():
    cfg = _cfg("grpo")
    cfg.name = "ppo"  # the registered names, and how to register one
    with pytest.raises(ValueError, match=r"'ppo' is not registered.*@espo_jax\.rl\.losses\."
                       r"register\(NAME, aggregation=\.\.\.\).*--config\.imports=MODULE"):
        losses.policy_loss(LOGP, OLD, ADV, MASK, cfg)
    for key, value in (("kl_estimator", "k4"), ("tis", "tokens"),
                       ("espo_token_ratio", "pi_old")):
        cfg = _cfg("grpo")
        cfg[key] = value
        with pytest.raises(ValueError, match=f"{key}='{value}' is not one of"):
            losses.policy_loss(LOGP, OLD, ADV, MASK, cfg)


def test_the_registry_does_not_import_the_config_section():
    # loss_config reads LOSSES; losses knows nothing of configs (no import circle).
    tree = ast.parse(pathlib.Path(losses.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "espo_jax.rl.loss_config" not in imported and "loss_config" not in names, imported
    assert {m for m in imported if m and m.startswith("espo_jax")} <= {
        "espo_jax.rl.aggregation", "espo_jax.rl.tis", "espo_jax.rl.token_stats"}


def test_paper_configs_and_registry():
    assert set(losses.LOSSES) == {"grpo", "dapo", "gspo", "gspo_token", "espo"}
    assert loss_config.paper_loss_config("dapo").clip_high == 0.28
    assert loss_config.paper_loss_config("gspo").clip_low == 3e-4
    for name in losses.LOSSES:
        loss_config.validate_loss_config(loss_config.paper_loss_config(name))
    with pytest.raises(ValueError, match="loss 'ppo' is not registered"):
        loss_config.paper_loss_config("ppo")


# Every key of `paper_loss_config(name)` as the three tables before the `LossSpec` registry gave
# it: the defaults, with DAPO's clip-higher 0.2 / 0.28 and GSPO's 3e-4 / 4e-4 (GSPO-token too).
_PAPER_DEFAULTS = {
    "aggregation": "auto", "aggregation_norm_len": 0, "espo_alpha": 0.02,
    "espo_high_entropy_frac": 0.2, "espo_token_ratio": "gspo_token", "kl_coef": 0.0,
    "kl_estimator": "k3", "tis": "off", "tis_cap": 2.0, "vocab_size": 151936,
    "kl_clamp": 0.0, "dual_clip": 0.0,  # verl's choices (10, 3), not the papers': off
}
PAPER_CONFIGS = {
    "grpo": {"clip_low": 0.2, "clip_high": 0.2},
    "dapo": {"clip_low": 0.2, "clip_high": 0.28},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
    "gspo_token": {"clip_low": 3e-4, "clip_high": 4e-4},
    "espo": {"clip_low": 0.2, "clip_high": 0.2},
}
PAPER_AGGREGATION = {
    "grpo": "seq_mean_token_mean", "dapo": "token_mean", "gspo": "seq_mean_token_mean",
    "gspo_token": "seq_mean_token_mean", "espo": "group_mean",
}


@pytest.mark.parametrize("name", sorted(PAPER_CONFIGS))
def test_paper_loss_config_values(name):
    expected = {**_PAPER_DEFAULTS, **PAPER_CONFIGS[name], "name": name}
    got = loss_config.paper_loss_config(name).to_dict()
    assert got == expected
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in expected.items()}
    assert list(got) == list(loss_config.default_loss_config())  # same keys, same order
    assert losses.aggregation_mode(loss_config.paper_loss_config(name)) == PAPER_AGGREGATION[name]
    assert set(losses.LOSSES) == set(PAPER_CONFIGS)  # a new loss gets a row here


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gspo_token", "espo"])
def test_jit_matches_eager(name):
    cfg = _cfg(name, tis="token", kl_coef=0.05)
    ent = jnp.asarray(np.abs(LOGP) % 2.0)
    kw = dict(entropy=ent, behaviour_logp=jnp.asarray(OLD) - 0.1, ref_logp=jnp.asarray(OLD) + 0.2)

    def f(lp):
        return losses.policy_loss(lp, OLD, ADV, MASK, cfg, **kw)

    eager_loss, eager_met = f(jnp.asarray(LOGP))
    jit_loss, jit_met = jax.jit(f)(jnp.asarray(LOGP))
    assert jit_loss == pytest.approx(float(eager_loss), rel=1e-6, abs=1e-7)
    for key in eager_met:
        assert jit_met[key] == pytest.approx(float(eager_met[key]), rel=1e-5, abs=1e-7), key
    g_eager = jax.grad(lambda lp: f(lp)[0])(jnp.asarray(LOGP))
    g_jit = jax.jit(jax.grad(lambda lp: f(lp)[0]))(jnp.asarray(LOGP))
    np.testing.assert_allclose(g_jit, g_eager, rtol=1e-5, atol=1e-7)


def test_a_registered_loss_is_validated_and_used(run_loss):
    # A new loss is a new function plus a LOSSES entry: REINFORCE J_t = r_t A_t, no clip.
    def reinforce(logp, old_logp, advantages, mask, config, *, entropy=None):
        ratio = jnp.exp(jnp.where(mask > 0, logp - old_logp, 0.0))
        ones = jnp.ones_like(ratio)
        return losses.Surrogate(ratio * advantages * mask, ratio, 0 * ones, 9 * ones, None, {})

    losses.LOSSES["reinforce"] = losses.LossSpec(reinforce, "token_mean", {"clip_high": 9.0})
    try:
        cfg = loss_config.paper_loss_config("reinforce")
        assert (cfg.clip_low, cfg.clip_high) == (0.2, 9.0)
        loss_config.validate_loss_config(cfg)
        assert losses.aggregation_mode(cfg) == "token_mean"  # aggregation="auto"
        loss, _, _ = run_loss(cfg, jnp.asarray(LOGP), OLD, ADV, MASK)
        # (0.7 + 1.1 + 1.3 - 0.7 - 1.1) / 5 = 1.3 / 5 = 0.26, unclipped.
        assert loss == pytest.approx(-0.26, abs=1e-6)
        losses.LOSSES["reinforce"] = losses.LossSpec(reinforce, "mean")
        with pytest.raises(ValueError, match=r"LOSSES\['reinforce'\].aggregation='mean'"):
            loss_config.validate_loss_config(cfg)
    finally:
        del losses.LOSSES["reinforce"]


def test_dual_clip_by_hand(run_loss):
    # One row, A = -1, ratios 0.9, 2.0, 4.0 (T = 3, seq_mean_token_mean, eps 0.2 / 0.2).
    ratios = np.array([[0.9, 2.0, 4.0]])
    old = np.full((1, 3), -1.0, np.float32)
    mask = np.ones((1, 3), np.float32)
    adv = np.full((1, 3), -1.0, np.float32)
    logp = jnp.asarray(old + np.log(ratios), jnp.float32)
    # Without dual clip: J = r * A for every token (r > 1 - eps, so none clipped):
    # (-0.9 - 2 - 4) / 3 = -2.3, loss 2.3.
    loss, met, g = run_loss(_cfg("grpo"), logp, old, adv, mask)
    assert loss == pytest.approx(2.3, rel=1e-5)
    # c = 3: the 4.0 token's J = -4 < c * A = -3 is bounded: (-0.9 - 2 - 3) / 3 = -1.9667, and
    # its gradient is 0; the others keep -A r / 3.
    loss, met, g = run_loss(_cfg("grpo", dual_clip=3.0), logp, old, adv, mask)
    assert loss == pytest.approx(5.9 / 3, rel=1e-5)
    assert met["pg/dual_clip_frac"] == pytest.approx(1 / 3)
    np.testing.assert_allclose(g, [[0.9 / 3, 2.0 / 3, 0.0]], rtol=1e-5, atol=1e-7)
    # Positive advantages are never dual-clipped.
    loss, met, _ = run_loss(_cfg("grpo", dual_clip=3.0), logp, old, -adv, mask)
    assert met["pg/dual_clip_frac"] == 0.0


def test_kl_clamp_by_hand(run_loss):
    # One token, logp = -1, ref = 2: d = ref - logp = 3; k3 = e^3 - 3 - 1 = 16.0855.
    one = np.ones((1, 1), np.float32)
    logp, ref = jnp.full((1, 1), -1.0), jnp.full((1, 1), 2.0)
    k3 = math.exp(3.0) - 4.0
    for clamp, want in ((0.0, k3), (10.0, 10.0), (20.0, k3)):
        cfg = _cfg("grpo", kl_coef=0.5, kl_clamp=clamp)
        loss, met, _ = run_loss(cfg, logp, logp, 0 * one, one, ref_logp=ref)
        assert met["kl/mean"] == pytest.approx(want, rel=1e-5)
        assert loss == pytest.approx(0.5 * want, rel=1e-5)


def test_register_adds_a_loss_and_refuses_a_taken_name():
    def reinforce(logp, old_logp, advantages, mask, config, *, entropy=None):
        ratio = jnp.exp(jnp.where(mask > 0, logp - old_logp, 0.0))
        return losses.Surrogate(objective=ratio * advantages * mask, ratio=ratio,
                                lower=jnp.zeros_like(ratio), upper=jnp.full_like(ratio, jnp.inf),
                                group_weights=None, metrics={})

    try:
        assert losses.register("reinforce", aggregation="token_mean")(reinforce) is reinforce
        assert losses.LOSSES["reinforce"] == losses.LossSpec(reinforce, "token_mean", {})
        losses.register("reinforce", aggregation="token_mean")(reinforce)  # a re-import: fine
        cfg = loss_config.paper_loss_config("reinforce")
        loss, _ = losses.policy_loss(jnp.asarray(LOGP), OLD, ADV, MASK, cfg)
        # Same surrogate as the test above, token mean: -(0.7 + 1.1 + 1.3 - 0.7 - 1.1) / 5.
        assert float(loss) == pytest.approx(-0.26, abs=1e-6)
        with pytest.raises(ValueError, match=r"loss 'grpo' is already registered \(espo_jax\.rl"
                           r"\.losses\.grpo\); choose another name"):
            losses.register("grpo", aggregation="token_mean")(reinforce)
        assert losses.LOSSES["grpo"].fn is losses.grpo
    finally:
        losses.LOSSES.pop("reinforce", None)
