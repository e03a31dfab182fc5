"""Learner batches: LPT balancing across data shards and packing of prompt + response rows."""

import numpy as np
import pytest

from espo_jax.train.batch import balance_rows, pack_sequences


def _loads(order, lengths, n_shards, rows_per_shard):
    n = len(lengths)
    return [
        sum(lengths[i] for i in order[d * rows_per_shard : (d + 1) * rows_per_shard] if i < n)
        for d in range(n_shards)
    ]


def test_balance_rows_lpt_by_hand():
    # lengths 5 3 8 2 7 1, 2 shards x 3 rows. Longest first, each to the lighter open shard
    # (ties to the lower shard):  8 -> s0 [8, 0];  7 -> s1 [8, 7];  5 -> s1 [8, 12];
    # 3 -> s0 [11, 12];  2 -> s0 [13, 12] (s0 now full);  1 -> s1 [13, 13].
    lengths = [5, 3, 8, 2, 7, 1]
    order = balance_rows(lengths, n_shards=2, rows_per_shard=3)
    assert order == [2, 1, 3, 4, 0, 5]
    assert _loads(order, lengths, 2, 3) == [13, 13]


def test_balance_rows_beats_contiguous_split():
    # Contiguous rows would give shards [10 + 9, 2 + 1] = [19, 3]; LPT: 10 -> s0, 9 -> s1,
    # 2 -> s1 (9 < 10), 1 -> s0: [11, 11].
    lengths = [10, 9, 2, 1]
    order = balance_rows(lengths, n_shards=2, rows_per_shard=2)
    assert order == [0, 3, 1, 2]
    assert _loads(order, lengths, 2, 2) == [11, 11]


def test_balance_rows_pads_with_indices_past_the_end():
    # 3 sequences of 4 in 2 x 2 rows: 0 -> s0, 1 -> s1, 2 -> s0 (tie: lower shard); padding
    # index 3 fills the last row of s1.
    order = balance_rows([4, 4, 4], n_shards=2, rows_per_shard=2)
    assert order == [0, 2, 1, 3]
    assert sorted(order) == [0, 1, 2, 3]


def test_balance_rows_too_many_sequences():
    with pytest.raises(ValueError, match="5 sequences do not fit 2 shards x 2 rows"):
        balance_rows([1] * 5, n_shards=2, rows_per_shard=2)


def _routing(n_tokens, m=2, k=2, base=0):
    """[n_tokens, m, k] with distinct values 100*base + 10*t + 2*layer + j; last row -1 (the
    final sampled token is never fed forward, so it has no routing)."""
    t, layer, j = np.meshgrid(np.arange(n_tokens), np.arange(m), np.arange(k), indexing="ij")
    r = 100 * base + 10 * t + 2 * layer + j
    r[-1] = -1
    return r.astype(np.int16)


def test_pack_sequences_alignment_by_hand():
    prompts = [np.array([1, 2, 3]), np.array([1, 6])]
    responses = [np.array([4, 5]), np.array([7, 8, 9])]
    blogps = [np.array([-0.5, -0.25]), np.array([-1.0, -2.0, -3.0])]
    routings = [_routing(5, base=1), _routing(5, base=2)]
    batch = pack_sequences(
        prompts, responses, blogps, routings, np.array([0.5, -0.5]), np.array([0.0, 1.0]),
        rows=3, seq_len=6, pad_id=0, moe_shape=(2, 2),
    )
    # Row 0: full = 1 2 3 4 5 -> inputs 1 2 3 4, targets 2 3 4 5; targets 4 and 5 (t = 2, 3)
    # are the response, whose behaviour log-probs sit at those same positions.
    np.testing.assert_array_equal(batch.tokens[0], [1, 2, 3, 4, 0, 0])
    np.testing.assert_array_equal(batch.targets[0], [2, 3, 4, 5, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.behaviour_logp[0], [0, 0, -0.5, -0.25, 0, 0])
    # Row 1: full = 1 6 7 8 9 -> response targets 7 8 9 at t = 1, 2, 3.
    np.testing.assert_array_equal(batch.tokens[1], [1, 6, 7, 8, 0, 0])
    np.testing.assert_array_equal(batch.targets[1], [6, 7, 8, 9, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[1], [0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.behaviour_logp[1], [0, -1, -2, -3, 0, 0])
    # Row 2 is padding: nothing in the loss.
    np.testing.assert_array_equal(batch.tokens[2], [0] * 6)
    np.testing.assert_array_equal(batch.loss_mask[2], [0] * 6)
    np.testing.assert_array_equal(batch.advantages, [0.5, -0.5, 0.0])
    np.testing.assert_array_equal(batch.zv_sign, [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(batch.positions[1], np.arange(6))
    # Routing follows the inputs: input t of row 0 is token t of the sequence, so routing row t.
    assert batch.routed_experts.shape == (3, 6, 2, 2)
    np.testing.assert_array_equal(batch.routed_experts[0, :4], routings[0][:4])
    np.testing.assert_array_equal(batch.routed_experts[1, :4], routings[1][:4])
    assert batch.routed_experts[0, 1, 1, 0] == 100 + 10 * 1 + 2 * 1 + 0
    assert (batch.routed_experts[:, 4:] == -1).all() and (batch.routed_experts[2] == -1).all()


def test_pack_sequences_rows_follow_the_balanced_order():
    # Total lengths 2+0=2, 2+4=6, 2+1=3, 2+3=5 over 2 shards x 2 rows: LPT order [1, 0, 3, 2]
    # (6 -> s0, 5 -> s1, 3 -> s1, 2 -> s0). Row r must hold sequence order[r] with its
    # advantage and sign.
    prompts = [np.array([1, 50])] * 4
    responses = [np.array([], np.int32), np.array([10, 11, 12, 13]), np.array([20]),
                 np.array([30, 31, 32])]
    blogps = [np.full(len(r), -0.1 * (i + 1), np.float32) for i, r in enumerate(responses)]
    adv = np.array([1.0, 2.0, 3.0, 4.0])
    batch = pack_sequences(prompts, responses, blogps, None, adv, np.array([0, -1, 1, 0]),
                           rows=4, seq_len=6, pad_id=0, n_shards=2)
    np.testing.assert_array_equal(batch.advantages, [2.0, 1.0, 4.0, 3.0])
    np.testing.assert_array_equal(batch.zv_sign, [-1.0, 0.0, 0.0, 1.0])
    np.testing.assert_array_equal(batch.targets[0], [50, 10, 11, 12, 13, 0])
    np.testing.assert_array_equal(batch.loss_mask.sum(axis=1), [4, 0, 3, 1])
    # The empty response (row 1) contributes no target; its inputs are the prompt minus its last.
    np.testing.assert_array_equal(batch.tokens[1], [1, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(batch.behaviour_logp[2], [0, -0.4, -0.4, -0.4, 0, 0])
    assert batch.routed_experts is None


def test_pack_sequences_errors():
    p, r, lp = [np.array([1, 2, 3])], [np.arange(4, 9)], [np.zeros(5)]
    # 3 + 5 = 8 tokens need 7 inputs; seq_len 6 holds 6 inputs (7 tokens).
    with pytest.raises(ValueError, match="8 tokens exceeds seq_len \\+ 1 = 7"):
        pack_sequences(p, r, lp, None, np.zeros(1), np.zeros(1), rows=2, seq_len=6, pad_id=0)
    # Exactly seq_len + 1 tokens fit.
    b = pack_sequences(p, r, lp, None, np.zeros(1), np.zeros(1), rows=2, seq_len=7, pad_id=0)
    assert b.loss_mask[0].sum() == 5
    with pytest.raises(ValueError, match="batch rows 3 not divisible by data shards 2"):
        pack_sequences(p, r, lp, None, np.zeros(1), np.zeros(1), rows=3, seq_len=7, pad_id=0,
                       n_shards=2)
    with pytest.raises(ValueError, match="do not fit"):
        pack_sequences(p * 3, r * 3, lp * 3, None, np.zeros(3), np.zeros(3), rows=2,
                       seq_len=7, pad_id=0)


def test_pack_sequences_rejects_empty_prompt_and_short_logprobs():
    with pytest.raises(ValueError, match="sequence 0 has an empty prompt"):
        pack_sequences([np.array([], np.int32)], [np.array([4, 5])], [np.zeros(2)], None,
                       np.zeros(1), np.zeros(1), rows=1, seq_len=4, pad_id=0)
    with pytest.raises(ValueError, match="sequence 1 has 2 response tokens but 1 behaviour"):
        pack_sequences([np.array([1])] * 2, [np.array([4]), np.array([4, 5])],
                       [np.zeros(1), np.zeros(1)], None, np.zeros(2), np.zeros(2), rows=2,
                       seq_len=4, pad_id=0)


@pytest.mark.parametrize("pack,share", [(False, False), (True, False), (True, True)])
def test_pack_sequences_untrained_sequence_keeps_its_place_with_no_loss(pack, share):
    # Sequence 1 (a response whose reward call failed) is packed like the others, its loss
    # mask row left 0; every other array is the same as with every sequence trained.
    prompts = [np.array([1, 2, 3]), np.array([1, 2, 3]), np.array([1, 6])]
    responses = [np.array([4, 5]), np.array([7, 8, 9]), np.array([10])]
    blogps = [np.full(len(r), -0.5, np.float32) for r in responses]
    routings = [_routing(len(p) + len(r), base=i) for i, (p, r) in
                enumerate(zip(prompts, responses, strict=True))]
    kw = dict(rows=4, seq_len=6, pad_id=0, n_shards=2, moe_shape=(2, 2), pack=pack,
              share_prompts=share)
    args = (prompts, responses, blogps, routings, np.array([0.5, 0.0, -0.5]),
            np.array([0.0, 0.0, 1.0]))
    ref = pack_sequences(*args, **kw)
    got = pack_sequences(*args, trained=np.array([True, False, True]), **kw)
    every = pack_sequences(*args, trained=[True] * 3, **kw)
    for name in ref.__dataclass_fields__:
        x, y, z = getattr(ref, name), getattr(got, name), getattr(every, name)
        if name == "token_weights":  # below
            continue
        if x is None:
            assert y is None and z is None, name
            continue
        np.testing.assert_array_equal(z, x, err_msg=name)  # all trained == no mask given
        if name != "loss_mask":
            np.testing.assert_array_equal(y, x, err_msg=name)
    # Sequence 1's 5 inputs leave the MoE aux losses' weights, wherever they lie (its own
    # columns, or its share of a shared prompt's copy); no other token's weight changes.
    weights = ref.token_weights
    if not (share and pack):  # 1 on every real token
        np.testing.assert_array_equal(weights, ref.segment_ids > 0)
    assert (got.token_weights <= weights).all() and (got.token_weights >= 0).all()
    assert weights.sum() - got.token_weights.sum() == len(prompts[1]) + len(responses[1]) - 1
    # Only sequence 1's 3 response targets leave the loss: one row loses 3 tokens, the other
    # rows keep theirs (2 and 1), padding none.
    lost = (ref.loss_mask - got.loss_mask).sum(axis=1)
    assert sorted(lost.tolist()) == [0, 0, 0, 3] and got.loss_mask.sum() == 3
    assert (got.loss_mask <= ref.loss_mask).all()
    with pytest.raises(ValueError, match="trained has 2 entries for 3 sequences"):
        pack_sequences(*args, trained=[True, False], **kw)


def test_a_response_longer_than_head_len_is_named():
    p, r, lp = [np.array([1, 2])], [np.array([4, 5, 6])], [np.zeros(3)]
    with pytest.raises(ValueError, match="response of 3 tokens exceeds head_len = 2"):
        pack_sequences(p, r, lp, None, np.zeros(1), np.zeros(1), rows=2, seq_len=6, pad_id=0,
                       head_len=2)
