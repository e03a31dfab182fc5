"""One train-inference mismatch computation, one set of names (`espo_jax.mismatch`)."""

import jax
import numpy as np
import pytest

from espo_jax import mismatch
from espo_jax.train.step import unpack_rows


def test_mismatch_metrics_by_hand():
    # Two response tokens (the third position is padding): log r = learner - rollout = 0.5, 0.
    learner = np.array([[-1.0, -2.0, 0.0]], np.float32)
    rollout = np.array([[-1.5, -2.0, -7.0]], np.float32)
    mask = np.array([[1.0, 1.0, 0.0]], np.float32)
    # MoE layers M = 2, top-k 2. Position 0: layer 0 the same set in another order, layer 1 a
    # different set; position 1 the same sets; position 2 not recorded (-1).
    own = np.array([[[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 1], [0, 1]]]], np.int32)
    rec = np.array([[[[1, 0], [2, 1]], [[2, 1], [3, 0]], [[-1, -1], [-1, -1]]]], np.int32)
    m = jax.device_get(mismatch.mismatch_metrics(learner, rollout, mask, own_BxTxMxk=own,
                                                 recorded_BxTxMxk=rec))
    assert m["mismatch/logp_abs_mean"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert m["mismatch/logp_abs_max"] == pytest.approx(0.5)
    # k3 = mean(r - 1 - log r) = (e^0.5 - 1.5 + 0) / 2
    assert m["mismatch/kl_k3"] == pytest.approx((np.exp(0.5) - 1.5) / 2, rel=1e-6)
    assert m["mismatch/is_weight_max"] == pytest.approx(np.exp(0.5), rel=1e-6)
    assert m["mismatch/tokens"] == 2
    # Two recorded positions: layer 0 never flips, layer 1 flips at position 0.
    assert m["moe/routing_flip_rate/layer_0"] == 0.0
    assert m["moe/routing_flip_rate/layer_1"] == pytest.approx(0.5)
    assert m["moe/routing_flip_rate"] == pytest.approx(0.25)
    assert m["mismatch/tokens_at_flips"] == 1  # position 0 predicts a response token
    assert m["mismatch/logp_abs_mean_at_flips"] == pytest.approx(0.5)
    assert m["mismatch/logp_abs_mean_elsewhere"] == pytest.approx(0.0)
    # A shared prompt's position counted three times: layer 1 flips at 3 of 4 weighted positions.
    w = np.array([[3.0, 1.0, 1.0]], np.float32)
    mw = mismatch.mismatch_metrics(learner, rollout, mask, own_BxTxMxk=own,
                                   recorded_BxTxMxk=rec, position_weights_BxT=w)
    assert float(mw["moe/routing_flip_rate/layer_1"]) == pytest.approx(0.75)


def test_mismatch_metrics_of_packed_rows_are_the_padded_ones():
    # Two sequences (3 and 2 positions) one per row on the loss side, [B, T] = [2, 3]; on the
    # model side one packed row of 6: sequence 0 at columns 0-2, sequence 1 at 3-4, column 5
    # padding. `unpack` maps each loss-side position to its flat model index (6: none).
    learner = np.array([[0.0, -1.0, -2.0], [-1.0, -3.0, 0.0]], np.float32)
    rollout = np.array([[0.0, -1.5, -2.0], [-1.25, -3.0, 0.0]], np.float32)
    mask = np.array([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]], np.float32)
    unpack = np.array([[0, 1, 2], [3, 4, 6]], np.int32)
    # One MoE layer, top-1: the live router differs at sequence 0's position 1 and sequence
    # 1's position 0.
    rec = np.array([0, 1, 2, 3, 4, -1], np.int32).reshape(1, 6, 1, 1)
    own = np.array([0, 5, 2, 7, 4, 0], np.int32).reshape(1, 6, 1, 1)
    # As the learner does: routing on the model's rows, the flips read through `unpack`.
    routing, flipped = mismatch.routing_metrics(own, rec)
    packed = jax.device_get({**mismatch.logp_metrics(learner, rollout, mask,
                                                     unpack_rows(flipped, unpack)), **routing})

    def pad(x, fill):  # the same routing one row per sequence, [2, 3, 1, 1]
        return np.concatenate([x[:, :5], np.full((1, 1, 1, 1), fill)], axis=1).reshape(2, 3, 1, 1)

    padded = jax.device_get(mismatch.mismatch_metrics(
        learner, rollout, mask, own_BxTxMxk=pad(own, 0), recorded_BxTxMxk=pad(rec, -1)))
    assert set(packed) == set(padded)
    for key in packed:
        assert float(packed[key]) == pytest.approx(float(padded[key])), key
    # |dlogp| = [[0, 0.5, 0], [0.25, 0, 0]]; both flips predict response tokens: at flips
    # (0.5 + 0.25) / 2, elsewhere 0; 2 of the 5 recorded positions flip.
    assert packed["mismatch/tokens_at_flips"] == 2
    assert packed["mismatch/logp_abs_mean_at_flips"] == pytest.approx(0.375)
    assert packed["mismatch/logp_abs_mean_elsewhere"] == 0.0
    assert packed["moe/routing_flip_rate"] == pytest.approx(0.4)


def test_mismatch_metrics_without_routing_and_half_given():
    x = np.zeros((1, 2), np.float32)
    m = mismatch.mismatch_metrics(x, x, np.ones((1, 2)))
    assert set(m) == {"mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/kl_k3",
                      "mismatch/is_weight_max", "mismatch/tokens"}
    with pytest.raises(ValueError, match="both own and recorded routing"):
        mismatch.mismatch_metrics(x, x, x, own_BxTxMxk=np.zeros((1, 2, 1, 1), np.int32))
