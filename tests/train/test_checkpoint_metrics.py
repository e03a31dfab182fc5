"""Checkpointer (real orbax): bitwise round trip of the train state and its JSON meta, keep-N,
explicit steps, a clear error when there is nothing to restore; and the metrics logger's JSONL."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax import configs
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.rewards import reward_adjust
from espo_jax.rl.advantages import ADVANTAGES
from espo_jax.train import state as state_lib
from espo_jax.train.checkpoint import Checkpointer
from espo_jax.train.metrics import MetricLogger, inversion_rate, read_jsonl, rollout_metrics


def _state(seed):
    optim = configs.default_config().optim
    tx = state_lib.make_optimizer(optim, total_steps=10)
    k = jax.random.key(seed)
    params = {"w": jax.random.normal(k, (3, 4)), "b": jnp.arange(4.0) * seed}
    state = state_lib.create_train_state(params, tx, jax.random.fold_in(k, 7))
    grads = jax.tree.map(jnp.ones_like, params)
    state, _ = state_lib.apply_gradients(state, grads, jnp.float32(1.0))  # non-zero moments
    return state.replace(skipped=jnp.int32(seed))


def _host(state):
    return jax.device_get((state.params, state.opt_state, state.step, state.skipped,
                           jax.random.key_data(state.rng)))


def test_round_trip_keep_and_steps(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    meta = {"rl_step": 0, "cursor": {"version": 1, "streams": {"sync.a": [3, 0]}},
            "mismatch_sum": 0.1 + 0.2, "zve": {"order": [[0, 1], [2, 3]]}, "warmstart": {}}
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), {**meta, "rl_step": step})
    ckpt.wait()
    assert ckpt.latest_step() == 3
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["2", "3"]
    template = _state(0)  # structure and shardings only
    restored, got = ckpt.restore(template)
    for a, b in zip(jax.tree.leaves(_host(restored)), jax.tree.leaves(_host(_state(3))),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert got == {**meta, "rl_step": 3}
    assert got["mismatch_sum"] == 0.30000000000000004  # floats survive JSON exactly
    assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    older, got2 = ckpt.restore(template, step=2)
    assert got2["rl_step"] == 2 and int(older.skipped) == 2
    ckpt.close()


def test_restore_without_checkpoint_names_the_directory(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "empty"), async_save=False)
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*empty"):
        ckpt.restore(_state(0))
    ckpt.close()


def test_metric_logger_jsonl(tmp_path):
    logger = MetricLogger(str(tmp_path), tensorboard=False)
    out = logger.write(3, {"a": jnp.float32(1.5), "b": np.array([1.0, 3.0]), "c": float("nan")})
    logger.write(0, {"eval/accuracy": 0.25}, phase="eval")
    logger.close()
    assert out == {"a": 1.5, "b": 2.0, "c": out["c"]} and np.isnan(out["c"])  # arrays: mean
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    # Non-finite values are written as null, so the file stays strict JSON.
    assert records == [{"step": 3, "phase": "rl", "a": 1.5, "b": 2.0, "c": None},
                       {"step": 0, "phase": "eval", "eval/accuracy": 0.25}]
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])


def test_metric_logger_trim_drops_rejected_and_torn_rows_then_appends(tmp_path):
    logger = MetricLogger(str(tmp_path), tensorboard=False)
    for step in (1, 2, 3):
        logger.write(step, {"a": float(step)})
    logger._jsonl.write('{"step": 4, "phase": "rl", "a"')  # killed mid-write: a torn line
    logger._jsonl.flush()
    assert logger.trim(lambda row: row["step"] <= 2) == 2  # step 3 and the torn line
    logger.write(3, {"a": 30.0})  # appends to the trimmed file, not the replaced one
    logger.close()
    assert [(r["step"], r["a"]) for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [
        (1, 1.0), (2, 2.0), (3, 30.0)]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_rollout_metrics_by_hand():
    def group(outcomes, lengths):  # the records' own rewards are 7.0: never the ones reported
        return RolloutGroup(
            prompt_id="p", prompt_tokens=np.array([1]), policy_version=0, sampler="t",
            created_at=0.0,
            responses=[Response(tokens=np.full(n, 5), logprobs=np.zeros(n), outcome=o, reward=7.0)
                       for o, n in zip(outcomes, lengths, strict=True)])

    groups = [group([1, 0], [4, 6]), group([1, 1, 0], [2, 2, 6])]
    m = rollout_metrics(groups, [np.array([1.0, 0.0]), np.array([0.9, 1.0, -0.5])])
    # 3 of 5 right; rewards sum 1 + 0 + 0.9 + 1 - 0.5 = 2.4 -> mean 0.48, max 1.0;
    # lengths 4 + 6 + 2 + 2 + 6 = 20 -> mean 4.
    # The rewards are not the outcomes (a score is mixed in), so the inversion rate is logged:
    # no wrong response is rewarded at or above a right one of its group.
    assert m == {"rollout/accuracy": 0.6, "rollout/reward_mean": pytest.approx(0.48),
                 "rollout/reward_max": 1.0, "rollout/response_len_mean": 4.0,
                 "reward/inversion_rate": 0.0}
    # Rewards equal to the outcomes: nothing mixed in, no inversion metric.
    assert "reward/inversion_rate" not in rollout_metrics(
        groups, [np.array([1.0, 0.0]), np.array([1.0, 1.0, 0.0])])
    # A score that lifts a wrong response: group 1 has the pair (right 0.2, wrong 0.5),
    # inverted; group 2 the pairs (0.9, 0.9) (a tie counts: A_j >= A_i) and (1.0, 0.9): 2 of
    # 3 pairs inverted; the all-right group has no pairs.
    mixed = [group([1, 0], [4, 6]), group([1, 1, 0], [2, 2, 6]), group([1, 1], [3, 3])]
    rewards = [np.array([0.2, 0.5]), np.array([0.9, 1.0, 0.9]), np.array([0.3, 0.4])]
    assert rollout_metrics(mixed, rewards)["reward/inversion_rate"] == pytest.approx(2 / 3)
    assert rollout_metrics([], [])["rollout/reward_mean"] == 0.0
    with pytest.raises(ValueError, match="4 rewards for 5 responses"):
        rollout_metrics(groups, [np.array([1.0, 0.0]), np.array([0.9, 1.0])])


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_inversion_rate_of_rewards_is_that_of_every_advantage(name):
    """The metric reads rewards; every group-relative advantage keeps their order inside a
    group, so it equals `reward_adjust.inversion_rate` of the advantages (equal-size groups)."""
    rng = np.random.default_rng(0)
    outcomes = rng.integers(0, 2, size=(16, 6))
    rewards = (outcomes + rng.uniform(-1.0, 1.0, size=outcomes.shape)).astype(np.float32)
    groups = [RolloutGroup(
        prompt_id=f"p{i}", prompt_tokens=np.array([1]), policy_version=0, sampler="t",
        created_at=0.0, responses=[Response(tokens=np.full(2, 5), logprobs=np.zeros(2),
                                            outcome=int(o), reward=0.0) for o in row])
        for i, row in enumerate(outcomes)]
    got = inversion_rate(groups, rewards.reshape(-1).astype(np.float64))
    want = float(reward_adjust.inversion_rate(outcomes, ADVANTAGES[name](jnp.asarray(rewards))))
    assert 0.05 < got < 0.95  # the noise does invert some pairs, not all
    assert got == pytest.approx(want)
