"""The learner's logical-axis rules come from `config.mesh.rules` and act in its traced steps."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import pytest
from helpers.placement import addressable_shard_shapes
from jax.sharding import PartitionSpec

from espo_jax import configs, sharding
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
    rules = tuple((k, None) if k == "batch" else (k, v) for k, v in sharding.DEFAULT_RULES)
    lrn = _learner(rules)
    assert lrn.rules == rules
    assert lrn.batch_sharding.spec == PartitionSpec(None)  # replicated rows
    assert _learner().batch_sharding.spec == PartitionSpec(("data", "fsdp"))


def test_bad_rules_are_named():
    cfg = ml_collections.ConfigDict({"rules": (("batch", "dta"), ("heads", "tensor"),
                                               ("wings", None), "embed")})
    with pytest.raises(ValueError) as e:
        sharding.rules_from_config(cfg)
    msg = str(e.value)
    assert "'batch' -> 'dta': mesh axes are ('data', 'fsdp', 'expert', 'tensor')" in msg
    assert "unknown logical axis 'wings'" in msg
    assert "'embed' is not a (logical name, mesh axes) pair" in msg
