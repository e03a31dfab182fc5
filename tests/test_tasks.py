"""The task wiring (`espo_jax.tasks`): the RL reward function a config chooses, and the checks
on the choices it needs."""

import pytest

from espo_jax import configs


def _small():
    c = configs.default_config()
    configs.apply_small(c)
    return c


def test_step_credit_needs_arith_worked_solutions_and_stage_2():
    from espo_jax import tasks

    c = _small()
    assert tasks.reward_fn(c)[1] is None  # the default: the verifier on the answer
    c.zve.tie_break.wrong_score = "step_credit"
    c.zve.tie_break.enabled = True
    configs.validate(c, n_devices=1)
    reward, target = tasks.reward_fn(c)
    prompt = {"answer": "9", "solution": "a5=5,b+7=12,c-3=9#9"}
    assert reward("a5=5,b+7=12,c-3=8#8", target(prompt)) == {
        "reward": 0.0, "outcome": False, "step_credit": pytest.approx(2 / 3)}
    c.zve.tie_break.wrong_score = "partial"
    with pytest.raises(ValueError, match=r"wrong_score 'partial' is not one of \('zero'"):
        configs.validate(c, n_devices=1)
    c.zve.tie_break.wrong_score = "step_credit"
    c.zve.tie_break.enabled = False
    with pytest.raises(ValueError, match="needs worked solutions .* enabled=False"):
        configs.validate(c, n_devices=1)
