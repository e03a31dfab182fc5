"""Stage 2 tie-breaking: bounded length term inside the correct tier, right always beats wrong."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from espo_jax.rewards.shaping import length_score, tie_break_rewards


def test_by_hand():
    r = tie_break_rewards(np.array([1, 1, 0, 0]), np.array([10, 20, 5, 40]), max_len=40)
    # right, 10 of 40: score 1 - 2 * 10/40 = .5 -> 1 + .25 * tanh(.5) = 1.11553
    # right, 20 of 40: score 0 -> 1.0; wrong: score 0 -> 0 regardless of length
    np.testing.assert_allclose(r, [1 + 0.25 * math.tanh(0.5), 1.0, 0.0, 0.0], rtol=1e-6)
    longer = tie_break_rewards(np.array([1, 1]), np.array([10, 20]), max_len=40,
                               prefer="longer", tier_gap=2.0, band=0.1)
    # score -.5 and 0 -> 2 * (1 - .1 * tanh(.5)) and 2 * 1
    np.testing.assert_allclose(longer, [2 * (1 - 0.1 * math.tanh(0.5)), 2.0], rtol=1e-6)


def test_breaks_ties_only_where_lengths_differ():
    tied = np.array([[1, 1, 1], [1, 1, 1], [0, 0, 0]])
    lengths = np.array([[5, 9, 7], [6, 6, 6], [3, 8, 9]])
    r = tie_break_rewards(tied, lengths, max_len=16)
    spread = r.max(axis=1) - r.min(axis=1)
    assert spread[0] > 0  # all right, lengths differ: contrast
    assert spread[1] == 0 and spread[2] == 0  # equal lengths; all wrong: still tied
    assert r[0, 0] > r[0, 2] > r[0, 1]  # shorter ranks higher


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 64)), min_size=2, max_size=16),
       st.sampled_from(["shorter", "longer"]), st.floats(0.01, 0.49))
def test_right_always_beats_wrong(rows, prefer, band):
    outcomes = np.array([o for o, _ in rows])
    lengths = np.array([n for _, n in rows])
    r = tie_break_rewards(outcomes, lengths, max_len=64, prefer=prefer, band=band)
    if outcomes.any() and not outcomes.all():
        assert r[outcomes == 1].min() > r[outcomes == 0].max()
    assert np.all(np.abs(r - outcomes) < band + 1e-6)  # the term stays inside its band


def test_wrong_score_ranks_inside_the_wrong_tier():
    # Step credit .25 / .75 / 0 for three wrong responses, one right: wrong rewards
    # .25 * tanh(credit) (0.0612, 0.1588, 0), the right one 1 + .25 * tanh(1 - 2 * 10/40).
    r = tie_break_rewards(np.array([0, 0, 0, 1]), np.array([30, 30, 30, 10]), max_len=40,
                          wrong_score=np.array([0.25, 0.75, 0.0, 0.5]))
    np.testing.assert_allclose(
        r, [0.25 * math.tanh(0.25), 0.25 * math.tanh(0.75), 0.0, 1 + 0.25 * math.tanh(0.5)],
        rtol=1e-6)
    # An all-wrong group with different credits has reward contrast; equal credits do not.
    assert np.ptp(tie_break_rewards(np.zeros(3), np.full(3, 8), max_len=16,
                                    wrong_score=np.array([0, 0.5, 1]))) > 0.1
    assert np.ptp(tie_break_rewards(np.zeros(3), np.full(3, 8), max_len=16,
                                    wrong_score=np.full(3, 0.5))) == 0
    with pytest.raises(ValueError, match="wrong_score"):
        tie_break_rewards(np.array([0, 1]), np.array([1, 2]), max_len=4,
                          wrong_score=np.array([1.5, 0.0]))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="binary"):
        tie_break_rewards(np.array([0.5, 1.0]), np.array([1, 2]), max_len=4)
    with pytest.raises(ValueError, match="differ in shape"):
        tie_break_rewards(np.array([1, 0]), np.array([1, 2, 3]), max_len=4)
    with pytest.raises(ValueError, match="max_len=4"):
        length_score(np.array([5]), 4)
    with pytest.raises(ValueError, match="'fastest' is not one of"):
        length_score(np.array([1]), 4, prefer="fastest")
