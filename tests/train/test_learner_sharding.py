"""The learner's logical-axis rules come from `config.mesh.rules` and act in its traced steps."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from helpers.placement import addressable_shard_shapes
from jax.sharding import PartitionSpec

from espo_jax import configs, mesh_rules, sharding
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.models import get_preset
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.train import state as state_lib
from espo_jax.train.learner import Learner


def _learner(rules=None):
    c = configs.default_config()
    c.model.preset = "tiny"
    c.loss = paper_loss_config("espo")
    c.loss.vocab_size = 128
    c.rollout.prompts_per_step, c.zve.n_samples = 2, 2
    c.rollout.max_prompt_len = 32  # no task sizes it here (run_setup.build does in a run)
    c.mesh.data = 2
    if rules is not None:
        c.mesh.rules = rules
    model_config = get_preset("tiny")
    mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:2])
    params = sharding.init_sharded(model_config, mesh, rng=jax.random.key(0))
    tx = state_lib.make_optimizer(c.optim, total_steps=10)
    state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))(params)
    learner = Learner(c, model_config, mesh, jax.tree.map(lambda x: x.sharding, state))
    learner.example_state = state
    return learner


@pytest.fixture(scope="module")
def learner():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets 8 fake CPU devices)")
    return _learner()


def test_the_update_step_is_traced_with_activation_constraints(learner):
    # What `_run_compiled` lowers: the fused update step, under the rules. The model constrains
    # its residual stream in every layer, so the lowered step carries those constraints; the
    # same step lowered without the rules carries none of them.
    args = (learner.example_state, jax.device_put(learner._example_batch(),
                                                  learner.batch_sharding), None)
    with sharding.activation_sharding(learner.mesh, learner.rules):
        inside = learner._fused_step.lower(*args).as_text()
    outside = learner._fused_step.lower(*args).as_text()
    assert inside.count("sharding_constraint") >= 2 * get_preset("tiny").n_layers
    assert outside.count("sharding_constraint") == 0


def test_traced_steps_see_the_configured_rules(learner):
    # The model's residual constraint ("batch", "length", "embed") under the default rules puts
    # the batch on data x fsdp (data=2: two row halves); outside the learner's rules it is a
    # no-op (one whole copy).
    constrain = lambda x: nn.with_logical_constraint(x, ("batch", "length", "embed")) * 1.0
    x = jnp.ones((4, 3, 8))
    inside = learner._under_rules(jax.jit(constrain))(x)
    assert addressable_shard_shapes(inside) == [(2, 3, 8)] * 2
    outside = jax.jit(constrain)(x)
    assert addressable_shard_shapes(outside) == [(4, 3, 8)]


def test_batch_sharding_follows_the_batch_rule():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    rules = tuple((k, None) if k == "batch" else (k, v) for k, v in mesh_rules.DEFAULT_RULES)
    lrn = _learner(rules)
    assert lrn.rules == rules
    assert lrn.batch_sharding.spec == PartitionSpec(None)  # replicated rows
    assert _learner().batch_sharding.spec == PartitionSpec(("data", "fsdp", "expert"))


def test_bad_rules_are_named():
    cfg = ml_collections.ConfigDict({"rules": (("batch", "dta"), ("heads", "tensor"),
                                               ("wings", None), "embed")})
    with pytest.raises(ValueError) as e:
        mesh_rules.rules_from_config(cfg)
    msg = str(e.value)
    assert "'batch' -> 'dta': mesh axes are ('data', 'fsdp', 'expert', 'tensor')" in msg
    assert "unknown logical axis 'wings'" in msg
    assert "'embed' is not a (logical name, mesh axes) pair" in msg


def _packed_learner(pack: bool):
    c = configs.default_config()
    c.model.preset = "tiny"
    c.loss = paper_loss_config("espo")
    c.loss.vocab_size = 128
    c.rollout.prompts_per_step, c.zve.n_samples = 4, 4
    c.rollout.max_prompt_len, c.rollout.max_new_tokens = 8, 12
    c.train.replay, c.train.pack, c.mesh.data = "off", pack, 2
    model_config = get_preset("tiny")
    mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:2])
    params = sharding.init_sharded(model_config, mesh, rng=jax.random.key(0))
    tx = state_lib.make_optimizer(c.optim, total_steps=10)
    state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))(params)
    return Learner(c, model_config, mesh, jax.tree.map(lambda x: x.sharding, state)), state


def test_packed_update_over_two_data_shards_equals_the_unpacked_one():
    """`train.pack` on a 2-device data mesh: each shard's sequences packed into its own rows
    and indexed within them (`RLBatch.shards`); the update (old-policy pass, fused step) moves
    the parameters as the learner with one row per sequence does."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    rng = np.random.default_rng(0)
    groups, rewards = [], []
    for g in range(4):  # prompts of 2-8 tokens, responses of 1-12: the rows pack
        responses = [Response(tokens=rng.integers(1, 128, n), logprobs=-rng.random(n) - 0.5,
                              outcome=o, reward=float(o))
                     for n, o in zip(rng.integers(1, 13, 4), (1, 0, 0, 1), strict=True)]
        groups.append(RolloutGroup(prompt_id=str(g), prompt_tokens=rng.integers(1, 128, g * 2 + 2),
                                   policy_version=0, sampler="test", created_at=0.0,
                                   rewarded_at=0.0, responses=responses))
        rewards.append(np.array([r.reward for r in responses], np.float32))
    out = {}
    for pack in (False, True):
        learner, state = _packed_learner(pack)
        if pack:
            (batch,) = learner.update_batches(groups, rewards)[0]  # one part
            assert batch.shards == 2 and batch.unpack is not None
        before = jax.device_get(state.params)  # the update donates the state
        new_state, metrics = learner.update(state, groups, rewards)
        out[pack] = (jax.device_get(new_state.params), before), metrics
    (new_a, old), metrics_a = out[False]
    (new_b, _), metrics_b = out[True]
    # Adam's first step is about lr * sign(gradient): the gradient's norm and the log-probs
    # (their mismatch with the sampler's) say more than the parameters do.
    for key in ("train/loss", "train/grad_norm", "mismatch/logp_abs_mean"):
        np.testing.assert_allclose(metrics_b[key], metrics_a[key], rtol=1e-5, err_msg=key)
    for a, b, o in zip(jax.tree.leaves(new_a), jax.tree.leaves(new_b), jax.tree.leaves(old),
                       strict=True):
        np.testing.assert_allclose(b - o, a - o, rtol=0, atol=1e-6 + 1e-3 * np.abs(a - o).max())
