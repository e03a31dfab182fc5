"""Micro-batch gradient accumulation: the mean over micro-batches equals the full batch's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.rl.losses import aggregate, aggregation_weight
from espo_jax.train.accumulation import accumulate_gradients

# 4 rows of 3 tokens. Split in two micro-batches of 2 rows, the first holds 5 valid tokens in
# 2 rows, the second 1 token in 1 row plus an all-padding row (what balance_rows leaves).
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)
FEATURES = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0


def _loss(mode, params, mb):
    x = mb["features"] * params["w"]  # per-token value, d/dw = feature
    loss = aggregate(x, mb["mask"], mode)
    return loss, {"loss_mean": loss, "x_max": jnp.max(x * mb["mask"])}


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_weighted_micro_batches_equal_the_full_batch(mode):
    batch = {"features": jnp.asarray(FEATURES), "mask": jnp.asarray(MASK)}
    params = {"w": jnp.ones(())}
    loss_fn = functools.partial(_loss, mode)
    weight = functools.partial(lambda m, mb: aggregation_weight(mb["mask"], m), mode)
    full_loss, full_grads, _ = accumulate_gradients(loss_fn, params, batch, 1)
    loss, grads, metrics = jax.jit(
        lambda p, b: accumulate_gradients(loss_fn, p, b, 2, weight_fn=weight))(params, batch)
    # By hand. token_mean: the sum of the 6 valid features / 6 = (0+.1+.2+.3+.4+.6)/6 = 1.6/6.
    # seq_mean_token_mean: mean of the 3 non-empty rows' means = (.1 + .35 + .6) / 3 = 1.05/3.
    want = 1.6 / 6 if mode == "token_mean" else 1.05 / 3
    np.testing.assert_allclose(full_loss, want, rtol=1e-6)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], full_grads["w"], rtol=1e-6)  # loss is linear in w
    np.testing.assert_allclose(metrics["loss_mean"], want, rtol=1e-6)
    np.testing.assert_allclose(metrics["x_max"], 0.6, rtol=1e-6)  # extremes stay extremes
    # Equal weights (the old behaviour) average the micro-batch means instead: token_mean
    # (1.0/5 + .6/1) / 2 = 0.4, seq means ((.1+.35)/2 + .6/1) / 2 = 0.4125: both wrong.
    unweighted, _, _ = accumulate_gradients(loss_fn, params, batch, 2)
    np.testing.assert_allclose(unweighted, 0.4 if mode == "token_mean" else 0.4125, rtol=1e-6)
