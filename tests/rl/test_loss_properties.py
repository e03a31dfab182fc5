"""Property tests (hypothesis): finite outputs for any finite inputs and masks, no inversions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from espo_jax.rewards import reward_adjust
from espo_jax.rl import advantages, loss_config, losses

SHAPE = (3, 5)  # fixed so that each loss compiles once
SETTINGS = settings(max_examples=25, deadline=None, database=None, derandomize=True)


def _floats(lo, hi):
    return arrays(np.float32, SHAPE, elements=st.floats(lo, hi, width=32))


@st.composite
def batches(draw):
    """Log-probs in [-50, 0], advantages in [-100, 100], entropies in [0, 20], any mask.

    Masked positions hold arbitrary finite garbage up to 2^100 ~ 1e30 in every array.
    """
    mask = draw(arrays(np.bool_, SHAPE))
    if draw(st.booleans()):
        mask[draw(st.integers(0, SHAPE[0] - 1))] = False  # an all-masked row
    garbage = draw(_floats(-(2.0**100), 2.0**100))
    fields = {
        "logp": _floats(-50, 0),
        "old": _floats(-50, 0),
        "beh": _floats(-50, 0),
        "ref": _floats(-50, 0),
        "adv": _floats(-100, 100),
        "ent": _floats(0, 20),
    }
    out = {k: np.where(mask, draw(v), garbage) for k, v in fields.items()}
    out["mask"] = mask.astype(np.float32)
    return out


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gspo_token", "espo"])
def test_losses_are_finite_for_any_finite_input(name, run_loss):
    cfg = loss_config.default_loss_config()
    cfg.name = name
    cfg.kl_coef = 0.1
    cfg.tis = "sequence" if name.startswith("gspo") else "token"

    @SETTINGS
    @given(b=batches())
    def check(b):
        loss, met, grad = run_loss(
            cfg, b["logp"], b["old"], b["adv"], b["mask"],
            entropy=b["ent"], behaviour_logp=b["beh"], ref_logp=b["ref"],
        )  # fmt: skip
        assert np.isfinite(loss)
        assert all(np.isfinite(v) for v in met.values()), met
        assert np.all(np.isfinite(grad))
        assert not np.any(np.asarray(grad)[b["mask"] == 0])  # padding gets no gradient
        if not b["mask"].any():
            assert loss == 0.0

    check()


def test_fully_masked_batch_gives_zero_loss_and_neutral_metrics(run_loss):
    cfg = loss_config.default_loss_config()  # espo
    z = np.zeros(SHAPE, np.float32)
    loss, met, grad = run_loss(cfg, z - 1.0, z + 3.0, z + 5.0, z, entropy=z + 1)
    assert loss == 0.0 and not np.any(grad)
    assert met["is_ratio/min"] == met["is_ratio/max"] == 1.0
    assert met["pg/num_tokens"] == 0 and met["espo/group_size_high"] == 0


@SETTINGS
@given(
    x=_floats(-1e3, 1e3),
    mask=arrays(np.bool_, SHAPE),
    garbage=_floats(-(2.0**100), 2.0**100),
    mode=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]),
)
def test_aggregation_ignores_padding(x, mask, garbage, mode):
    # Extra masked columns and an extra masked row, full of garbage, change nothing.
    padded_x = np.full((4, 8), 0, np.float32) + garbage[0, 0]
    padded_x[:3, :5] = np.where(mask, x, garbage)
    padded_m = np.zeros((4, 8), bool)
    padded_m[:3, :5] = mask
    a = losses.aggregate(jnp.asarray(x), jnp.asarray(mask), mode)
    b = losses.aggregate(jnp.asarray(padded_x), jnp.asarray(padded_m), mode)
    assert np.isfinite(b)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-3)


@SETTINGS
@given(
    outcome=arrays(np.int32, (4, 6), elements=st.integers(0, 1)),
    score=arrays(np.float32, (4, 6), elements=st.floats(-(2.0**20), 2.0**20, width=32)),
    base=st.sampled_from(sorted(advantages.ADVANTAGES)),
)
def test_tiered_rewards_never_invert(outcome, score, base):
    a = advantages.ADVANTAGES[base](reward_adjust.tiered_rewards(outcome, score))
    assert reward_adjust.inversion_rate(outcome, a) == 0.0
    # ... and within each group every correct response strictly beats every wrong one.
    a = np.asarray(a)
    for g in range(outcome.shape[0]):
        right, wrong = a[g][outcome[g] == 1], a[g][outcome[g] == 0]
        if right.size and wrong.size:
            assert right.min() > wrong.max()


@SETTINGS
@given(
    outcome=arrays(np.int32, (3, 4), elements=st.integers(0, 1)),
    ent=arrays(np.float32, (3, 4, 5), elements=st.floats(0, 20, width=32)),
    mask=arrays(np.bool_, (3, 4, 5)),
)
def test_rl_zvp_signs_and_finiteness(outcome, ent, mask):
    rewards = outcome.astype(np.float32)
    got = np.asarray(advantages.rl_zvp(rewards, outcome, ent, mask, 0.05))
    assert np.all(np.isfinite(got)) and not np.any(got[~mask])
    for g in range(3):
        if outcome[g].all():
            assert np.all(got[g] >= 0)  # all correct: +alpha H
        elif not outcome[g].any():
            assert np.all(got[g] <= 0)  # all wrong: -alpha (max H - H)


def test_jitted_advantages_match_eager():
    # One program against op-by-op: XLA may sum a group in another order or divide by n as a
    # multiply by 1/n, so a group mean moves by up to (n + 1) eps max|r|; RLOO scales the
    # difference by n / (n - 1) <= 2, and a mean equal to every reward may come out a few
    # ulps off zero (the all-equal group).
    r = jnp.array([[1.0, 0.0, 2.0], [3.0, 3.0, 3.0]])
    n, eps = r.shape[1], float(jnp.finfo(jnp.float32).eps)
    bound = 2 * (n + 1) * eps * float(jnp.max(jnp.abs(r)))
    for name, fn in advantages.ADVANTAGES.items():
        np.testing.assert_allclose(jax.jit(fn)(r), fn(r), rtol=1e-6, atol=bound, err_msg=name)
