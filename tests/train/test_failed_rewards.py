"""A reward function that fails on every response stops the run after a checkpoint: its failed
rewards (0.0, outcome False) are never trained on as if the policy had been wrong. The default
experiment at laptop size, in process, with the task's verifier swapped for a broken one."""

import pytest
from helpers import reward_pool_fns

from espo_jax import configs, tasks
from espo_jax.train import loop
from espo_jax.train.checkpoint import Checkpointer


def test_reward_function_failing_everywhere_stops_the_run_after_a_checkpoint(tmp_path,
                                                                             monkeypatch):
    config = configs.experiment_config("arith_espo", "small")
    config.zve.offline.enabled = False  # the first RL step's rollouts meet the broken function
    config.checkpoint.every = 10  # the stop itself must save one
    config.eval.pass_k = 0
    monkeypatch.setattr(tasks, "reward_fn",
                        lambda c: (reward_pool_fns.always_fails, lambda p: p["answer"]))
    with pytest.raises(RuntimeError, match=r"RL step 1: the reward function failed \(or timed "
                       r"out\) on 100% of the step's responses, more than "
                       r"rollout.max_failed_reward_frac=0.5; the checkpoint of step 1 is saved"):
        loop.run_sync(config, str(tmp_path))
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    assert ckpt.latest_step() == 1
    ckpt.close()
