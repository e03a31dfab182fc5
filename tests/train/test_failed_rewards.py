"""A reward function that fails on every response stops the run after a checkpoint: its failed
rewards (0.0, outcome False) are never trained on as if the policy had been wrong, and the step
it stops at logs every outcome as missing. The default experiment at laptop size, in process,
with the task's verifier swapped for a broken one."""

import pytest
from helpers import reward_pool_fns

from espo_jax import configs, tasks
from espo_jax.train import loop
from espo_jax.train.checkpoint import Checkpointer
from espo_jax.train.metrics import read_jsonl


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
    # Step 1's metrics: every response's outcome is missing, no group has one; with RL-ZVP on
    # the filter passes every group, so what is trained is what was generated.
    m = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["phase"] == "rl"][-1]
    assert m["step"] == 1 and m["zve/rollouts_generated"] > 0
    assert m["zve/missing_outcomes"] == m["zve/rollouts_generated"]
    assert m["zve/missing_outcome_groups"] == m["zve/groups_generated"] == 4
    assert m["lengths/trained_mean"] == m["lengths/generated_mean"] > 0
    assert m["lengths/trained_p90"] == m["lengths/generated_p90"] > 0
