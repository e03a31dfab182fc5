"""Limits the losses must reach, padding invariance, and gradients against finite differences."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.rl import loss_config, losses

NAMES = ["grpo", "dapo", "gspo", "gspo_token", "espo"]
V = 1000  # vocab size for ESPO's log|V|


def _cfg(name, **overrides):
    cfg = loss_config.default_loss_config()
    cfg.name = name
    cfg.vocab_size = V
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def _batch(seed, B=3, T=6, lengths=(6, 4, 2)):
    """Random batch whose log-ratios sit well inside or well outside eps=0.1 (no kinks)."""
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 3.0, (B, T))
    log_r = rng.choice([-0.5, -0.03, 0.02, 0.04, 0.45], (B, T))
    mask = (np.arange(T)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
    adv = rng.normal(size=(B, T))
    ent = rng.uniform(0.2, 3.0, (B, T))
    f32 = functools.partial(np.asarray, dtype=np.float32)
    return f32(old + log_r), f32(old), f32(adv), mask, f32(ent)


def test_espo_single_group_is_gspo_token_with_its_eps(run_loss):
    logp, old, adv, mask, ent = _batch(0)
    # Rescale each row's entropies to masked mean 1.5, so every response has the same
    # eps = alpha * 1.5 / log V; alpha chosen so that eps = 0.1.
    ent = ent * 1.5 / ((ent * mask).sum(1, keepdims=True) / mask.sum(1, keepdims=True))
    alpha = 0.1 * math.log(V) / 1.5
    espo_cfg = _cfg("espo", espo_high_entropy_frac=1.0, espo_alpha=alpha)
    gspo_cfg = _cfg("gspo_token", clip_low=0.1, clip_high=0.1)
    l_e, m_e, g_e = run_loss(espo_cfg, logp, old, adv, mask, entropy=ent)
    l_g, m_g, g_g = run_loss(gspo_cfg, logp, old, adv, mask)
    assert m_e["espo/group_size_low"] == 0  # one group per response
    assert m_e["espo/eps_mean"] == pytest.approx(0.1, rel=1e-5)
    assert m_e["pg/clipfrac_high"] + m_e["pg/clipfrac_low"] > 0  # the clip is exercised
    assert l_e == pytest.approx(float(l_g), rel=1e-5)
    np.testing.assert_allclose(g_e, g_g, rtol=1e-5, atol=1e-7)
    for key in ("pg/clipfrac_low", "pg/clipfrac_high", "is_ratio/mean", "is_ratio/max"):
        assert m_e[key] == pytest.approx(float(m_g[key]), rel=1e-5), key


def _token_ppo_reference(logp, old, adv, mask, eps):
    """Independent token PPO clip with per-token eps, mean over tokens then responses."""
    r = jnp.exp(logp - old)
    term = jnp.minimum(r * adv, jnp.clip(r, 1 - eps, 1 + eps) * adv) * mask
    per_row = term.sum(1) / mask.sum(1)
    return -per_row.mean()


def test_espo_one_token_per_group_is_token_ppo_with_per_token_eps(run_loss):
    # Responses of 2 tokens (padded to T=4), frac 0.5 -> one high and one low token: each group
    # holds one token, so s_tau = r_t and eps_tau = alpha H_t / log V.
    logp, old, adv, mask, ent = _batch(1, B=4, T=4, lengths=(2, 2, 2, 2))
    alpha = 0.08 * math.log(V)  # eps_t = 0.08 H_t, between 0.016 and 0.24
    cfg = _cfg("espo", espo_high_entropy_frac=0.5, espo_alpha=alpha)
    loss, met, grad = run_loss(cfg, logp, old, adv, mask, entropy=ent)
    assert met["espo/group_size_high"] == 1 and met["espo/group_size_low"] == 1
    ref = jax.jit(
        functools.partial(_token_ppo_reference, old=old, adv=adv, mask=mask, eps=0.08 * ent)
    )
    assert loss == pytest.approx(float(ref(logp)), rel=1e-5)
    np.testing.assert_allclose(grad, jax.jit(jax.grad(ref))(logp), rtol=1e-5, atol=1e-7)
    # The printed token ratio sg[s_tau] pi / pi_old squares the ratio of a one-token group.
    cfg.espo_token_ratio = "as_printed"
    loss_p, _, _ = run_loss(cfg, logp, old, adv, mask, entropy=ent)
    assert loss_p == pytest.approx(float(ref(old + 2 * (logp - old))), rel=1e-5)


# REINFORCE weights: rows of 4 and 5 tokens, B = 2 (entropies distinct, frac 0.2 -> 1 high).
RF_MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], np.float32)
RF_ENT = np.array([[0.1, 0.9, 0.3, 0.2, 5.0], [0.4, 0.1, 0.2, 0.8, 0.3]], np.float32)
RF_WEIGHTS = {
    # seq_mean_token_mean: 1/(B |y_i|) = 1/8, 1/10
    "seq_mean_token_mean": [[1 / 8] * 4 + [0], [1 / 10] * 5],
    # token_mean: 1 / 9 tokens
    "token_mean": [[1 / 9] * 4 + [0], [1 / 9] * 5],
    # group_mean: 1/(B |groups| |tau|): high token 1/(2*2*1) = 1/4; row 0 low 1/(2*2*3) = 1/12,
    # row 1 low 1/(2*2*4) = 1/16. High tokens are t=1 (0.9) and t=3 (0.8).
    "group_mean": [[1 / 12, 1 / 4, 1 / 12, 1 / 12, 0], [1 / 16, 1 / 16, 1 / 16, 1 / 4, 1 / 16]],
}


@pytest.mark.parametrize("name", NAMES + ["espo_as_printed"])
def test_ratio_one_gives_reinforce_gradient(name, run_loss):
    cfg = _cfg("espo", espo_token_ratio="as_printed") if name == "espo_as_printed" else _cfg(name)
    rng = np.random.default_rng(2)
    old = np.asarray(-rng.uniform(0.1, 3, (2, 5)), np.float32)
    if name == "gspo":  # a sequence-level ratio needs a sequence-level advantage
        adv = np.repeat(np.array([[0.7], [-1.3]], np.float32), 5, axis=1)
    else:
        adv = np.asarray(rng.normal(size=(2, 5)), np.float32)
    _, met, grad = run_loss(cfg, old, old, adv, RF_MASK, entropy=RF_ENT)
    weights = RF_WEIGHTS[losses.LOSSES[cfg.name].aggregation]
    # d(-J)/d logp_t = -A_t w_t: the REINFORCE gradient with the aggregation's token weights.
    np.testing.assert_allclose(grad, -adv * np.array(weights), rtol=1e-5, atol=1e-7)
    assert met["is_ratio/min"] == met["is_ratio/max"] == 1.0
    assert met["pg/clipfrac_low"] == met["pg/clipfrac_high"] == 0.0


def _pad(arr, rows, cols, fill):
    out = np.full((arr.shape[0] + rows, arr.shape[1] + cols), fill, np.float32)
    out[: arr.shape[0], : arr.shape[1]] = arr
    return out


@pytest.mark.parametrize("name", NAMES)
def test_padding_changes_neither_loss_nor_gradient(name, run_loss):
    logp, old, adv, mask, ent = _batch(3, B=3, T=5, lengths=(5, 3, 1))
    beh, ref = old - 0.05, old + 0.1
    cfg = _cfg(name, tis="token", kl_coef=0.02, espo_alpha=0.05 * math.log(V))
    base = run_loss(cfg, logp, old, adv, mask, entropy=ent, behaviour_logp=beh, ref_logp=ref)
    # One all-masked row and 3 masked columns, all holding garbage (large finite values).
    garbage = {"logp": -77.0, "old": 55.0, "adv": 1e4, "ent": 1e3, "beh": -1e3, "ref": 33.0}
    padded_inputs = [
        _pad(x, 1, 3, garbage[k])
        for k, x in zip(garbage, (logp, old, adv, ent, beh, ref), strict=True)
    ]
    p_logp, p_old, p_adv, p_ent, p_beh, p_ref = padded_inputs
    p_mask = _pad(mask, 1, 3, 0.0)
    padded = run_loss(
        cfg, p_logp, p_old, p_adv, p_mask, entropy=p_ent, behaviour_logp=p_beh, ref_logp=p_ref
    )
    assert padded[0] == pytest.approx(float(base[0]), rel=1e-6, abs=1e-7)
    for key, value in base[1].items():
        assert padded[1][key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
    np.testing.assert_allclose(padded[2][:3, :5], base[2], rtol=1e-5, atol=1e-8)
    assert not np.any(padded[2][3:]) and not np.any(padded[2][:, 5:])


def _central_differences(fn, x, h=1e-6):
    """d fn / d x by central differences, one coordinate at a time (float64)."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[idx] = h
        grad[idx] = (float(fn(x + step)) - float(fn(x - step))) / (2 * h)
    return grad


def _frozen_surrogate(cfg, lp0, old, adv, mask, ent, beh, ref):
    """GSPO-token / ESPO loss with every stop-gradient factor frozen at lp0 (numpy, float64).

    Their gradient is by construction not the derivative of their value (sg[s] * pi / sg[pi]):
    it is the derivative of this function, in which only pi(y_t) / pi(y_t)|_{lp0} moves.
    """
    valid = mask > 0
    if cfg.name == "espo":
        high = np.asarray(losses.espo_entropy_groups(ent, mask, cfg.espo_high_entropy_frac))
        groups = [high, valid & ~high]
    else:
        groups = [valid]
    n_groups = sum(g.any(1, keepdims=True) for g in groups)
    s0, eps, w = (np.zeros_like(lp0) for _ in range(3))
    for g in groups:
        size = np.maximum(g.sum(1, keepdims=True), 1)
        s_g = np.exp(((lp0 - old) * g).sum(1, keepdims=True) / size)
        h_g = (ent * g).sum(1, keepdims=True) / size
        s0 += g * s_g
        eps += g * (cfg.espo_alpha * h_g / math.log(cfg.vocab_size) if cfg.name == "espo" else 0)
        w += g / (size * n_groups if cfg.name == "espo" else size)
    w /= valid.any(1).sum()  # mean over responses
    lower = 1 - (eps if cfg.name == "espo" else cfg.clip_low)
    upper = 1 + (eps if cfg.name == "espo" else cfg.clip_high)
    tis = np.minimum(np.exp(old - beh), cfg.tis_cap)

    def loss(lp):
        r = s0 * np.exp(lp - lp0)
        obj = np.minimum(r * adv, np.clip(r, lower, upper) * adv)
        d = ref - lp
        kl = np.exp(d) - d - 1
        return -(w * tis * obj * mask).sum() + cfg.kl_coef * (w * kl * mask).sum()

    return loss


@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_finite_differences(name):
    logp, old, adv, mask, ent = (np.asarray(x, np.float64) for x in _batch(4))
    cfg = _cfg(
        name,
        tis="token",
        tis_cap=1.5,
        kl_coef=0.1,
        clip_low=0.1,
        clip_high=0.1,
        espo_alpha=0.1 * math.log(V),
    )
    beh = old - np.linspace(-0.6, 0.6, old.shape[1])  # weights e^-.6 .. e^.6, some above cap
    ref = old + 0.2
    with jax.enable_x64(True):  # float64 so finite differences are meaningful

        def f(lp):
            kw = dict(entropy=ent, behaviour_logp=beh, ref_logp=ref)
            return losses.policy_loss(lp, old, adv, mask, cfg, **kw)

        f_and_grad = jax.jit(jax.value_and_grad(f, has_aux=True))  # one compile for all calls
        (loss, met), grad = f_and_grad(logp)
        assert loss.dtype == jnp.float64
        assert met["pg/clipfrac_low"] + met["pg/clipfrac_high"] > 0  # clipped tokens present
        assert met["tis/truncated_frac"] > 0
        if name in ("grpo", "dapo", "gspo"):  # the gradient of the value itself
            numeric = _central_differences(lambda lp: f_and_grad(lp)[0][0], logp)
        else:
            frozen = _frozen_surrogate(cfg, logp, old, adv, mask, ent, beh, ref)
            assert frozen(logp) == pytest.approx(float(loss), rel=1e-10)
            numeric = _central_differences(frozen, logp)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
    assert np.count_nonzero(grad) > mask.sum() / 2  # not trivially all zero
