"""MS-ZVE stage 2: each group's rewards, read from the RolloutGroup, never written back."""

import numpy as np
from helpers.zve_groups import make_group, reward_fields

from espo_jax.rewards.shaping import tie_break_rewards
from espo_jax.zve.config import default_zve_config
from espo_jax.zve.tie_break import group_rewards, score_groups


def test_stage_off_rewards_are_the_outcomes():
    g = make_group([1, 0, 1], [3, 5, 7], rewards=[9.0, 9.0, 9.0])
    r = group_rewards(g, default_zve_config().tie_break, max_len=16)
    assert r.dtype == np.float32 and r.tolist() == [1.0, 0.0, 1.0]
    assert reward_fields([g]) == [[9.0, 9.0, 9.0]]  # the reward function's, untouched


def test_tie_break_is_the_shaping_formula_on_outcomes_and_lengths():
    cfg = default_zve_config().tie_break
    cfg.enabled = True
    g = make_group([1, 1, 0], [3, 5, 7], credits=[0.0, 0.0, 0.5])
    expected = tie_break_rewards(np.array([1, 1, 0]), np.array([3, 5, 7]), max_len=16,
                                 prefer="shorter", tier_gap=1.0, band=0.25)
    np.testing.assert_array_equal(group_rewards(g, cfg, max_len=16), expected)
    assert expected[0] > expected[1] > expected[2] == 0.0  # shorter right first; wrong at 0
    # wrong_score="step_credit": the wrong response is ranked by its step credit
    cfg.wrong_score = "step_credit"
    with_credit = tie_break_rewards(np.array([1, 1, 0]), np.array([3, 5, 7]), max_len=16,
                                    wrong_score=np.array([0.0, 0.0, 0.5], np.float32))
    np.testing.assert_array_equal(group_rewards(g, cfg, max_len=16), with_credit)
    assert 0.0 < with_credit[2] < with_credit[1]
    # a response without the component counts 0
    plain = make_group([1, 1, 0], [3, 5, 7])
    np.testing.assert_array_equal(group_rewards(plain, cfg, max_len=16), expected)
    scored = score_groups([g, plain], cfg, max_len=16)
    assert [s.group for s in scored] == [g, plain]
    np.testing.assert_array_equal(scored[0].rewards, with_credit)
    assert reward_fields([g, plain]) == [[1.0, 1.0, 0.0]] * 2
