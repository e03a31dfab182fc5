"""A reward function that fails on every response stops the run after a checkpoint: its failed
rewards (0.0, outcome False) are never trained on as if the policy had been wrong, and the step
it stops at logs every outcome as missing. The default experiment at laptop size, in process,
with the task's verifier swapped for a broken one. The failed calls a group lists reach the
worker layout's learner through the buffer's records."""

import numpy as np
import pytest
from helpers import reward_pool_fns

from espo_jax import configs, tasks
from espo_jax.buffer.records import Response, RolloutGroup, decode, encode
from espo_jax.train import loop
from espo_jax.train.advantages import group_advantages, trained_responses
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
    # the filter passes every group into the batch, but no response enters the loss.
    m = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["phase"] == "rl"][-1]
    assert m["step"] == 1 and m["zve/rollouts_generated"] > 0
    assert m["zve/missing_outcomes"] == m["zve/rollouts_generated"]
    assert m["zve/missing_outcome_groups"] == m["zve/groups_generated"] == 4
    assert m["lengths/generated_mean"] > 0 and m["lengths/trained_mean"] == 0.0
    # ... and the learner leaves every one of them out of the loss: no policy-gradient term.
    assert m["train/masked_failed_responses"] == m["zve/rollouts_generated"]
    assert m["pg/loss"] == 0.0
    assert m["lengths/generated_p90"] > 0 and m["lengths/trained_p90"] == 0.0
    # The step's samples say so too: every chosen response an "error", none trained on.
    rows = read_jsonl(str(tmp_path / "samples.jsonl"))
    assert len(rows) == config.log.samples_per_step * config.zve.n_samples
    assert {(r["step"], r["outcome"], r["reward"], r["advantage"]) for r in rows} == {
        (1, "error", 0.0, 0.0)}


def test_failed_reward_calls_survive_the_record_round_trip():
    # The worker layout's learner reads groups decoded from the buffer: the failed calls the
    # rollout side listed must arrive, so its advantages and loss masks are the in-process ones.
    responses = [Response(tokens=np.array([5, 6]), logprobs=np.zeros(2), outcome=o, reward=rw)
                 for o, rw in ((True, 1.0), (False, 0.0), (False, 0.0))]
    group = RolloutGroup(prompt_id="p", prompt_tokens=np.array([1, 4]), policy_version=3,
                         sampler="jax-fp32", created_at=0.0, responses=responses,
                         meta={"reward_failed": [2], "worker": "rollout-0"})
    back = decode(encode(group))
    assert back.meta == {"reward_failed": [2], "worker": "rollout-0"}
    rewards = [np.array([1.0, 0.0, 0.0], np.float32)]
    # GRPO of the scored [1, 0]: +-0.5 / (0.5 + 1e-6); the failed response 0 and untrained.
    a = 0.5 / (0.5 + 1e-6)
    for g in (group, back):
        adv, sign = group_advantages([g], rewards, "grpo", use_zvp=True)
        np.testing.assert_allclose(adv, [a, -a, 0.0], rtol=1e-6)
        np.testing.assert_array_equal(sign, [0, 0, 0])
        np.testing.assert_array_equal(trained_responses([g]), [True, True, False])
