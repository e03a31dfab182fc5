"""Sharding on 8 fake CPU devices (tests/conftest.py): mesh data=2 x expert=4, expert weights
really split, the batch over every axis, the MoE layers expert parallel (all-to-alls in the
compiled step), forward and gradients equal to one device within 1e-5."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.placement import addressable_shard_shapes
from jax.sharding import PartitionSpec

from espo_jax import mesh_rules, sharding
from espo_jax.models import forward, get_preset


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The axis sizes of an experiment's `config.mesh` (one may be -1: all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1


TINY = get_preset("tiny", z_loss_coef=0.01)
MESH_CFG = MeshConfig(data=2, fsdp=1, expert=4, tensor=1)


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets 8 fake CPU devices)")
    return sharding.make_mesh(MESH_CFG, jax.devices()[:8])


@pytest.fixture(scope="module")
def sharded_params(mesh):
    return sharding.init_sharded(TINY, mesh, rng=jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(2), (8, 12), 0, TINY.vocab_size)  # 1 row a device


def loss_fn(params, tokens, config=TINY):
    out = forward(config, params, tokens)
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)) + out.aux_loss, out


def test_mesh_axes_are_auto_and_sized(mesh):
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    # -1 takes the remaining devices: 8 / (fsdp 1 * expert 2 * tensor 1) = 4
    assert mesh_rules.mesh_shape(MeshConfig(data=-1, expert=2), 8) == (4, 1, 2, 1)


def test_bad_mesh_and_divisibility_name_the_numbers(mesh):
    with pytest.raises(ValueError, match=r"data\*fsdp\*expert\*tensor = 2\*1\*4\*2 = 16 != 8"):
        mesh_rules.mesh_shape(MeshConfig(data=2, expert=4, tensor=2), 8)
    with pytest.raises(ValueError, match=r"layers_0/moe/wi_gate dim 0 \(size 6\) is not "
                                         r"divisible by mesh axes \('expert',\) \(size 4\)"):
        sharding.validate_divisibility(TINY.replace(n_experts=6), mesh)


def test_expert_weights_are_split_on_the_expert_axis(sharded_params):
    wi = sharded_params["layers_0"]["moe"]["wi_gate"]
    assert wi.sharding.spec == PartitionSpec("expert", "fsdp", "tensor")
    # 8 experts over expert=4: each device holds 2 experts; data=2 replicates each shard twice
    assert addressable_shard_shapes(wi) == [(2, 64, 32)] * 8
    assert len({d.id for d in wi.devices()}) == 8
    emb = sharded_params["embed"]["embedding"]
    # a dense weight's model dimension over fsdp x expert (1 x 4): 64 / 4; tensor is 1
    assert addressable_shard_shapes(emb) == [(128, 16)] * 8


def test_sharded_init_equals_single_device_init(sharded_params, tiny_params):
    # same key and same (partitionable) RNG bits: the same values, only placed differently
    # (up to float rounding of the bits-to-normal transform: tiny_params is compiled with
    # XLA optimisation level 0, see conftest.py)
    for a, b in zip(jax.tree_util.tree_leaves(sharded_params),
                    jax.tree_util.tree_leaves(tiny_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


def test_forward_and_grads_match_single_device(mesh, sharded_params, tiny_params, tokens, jit):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (l1, out1), g1 = jit(grad_fn)(tiny_params, tokens)

    shardings = sharding.param_shardings(TINY, mesh)
    tok = jax.device_put(tokens, sharding.batch_sharding(mesh))

    step = jit(grad_fn, out_shardings=((None, None), shardings))
    with sharding.activation_sharding(mesh):  # traced here: the constraints apply
        (l8, out8), g8 = step(sharded_params, tok)
        # residual stream constrained after the embedding and each of the 2 blocks (forward)
        lowered = step.lower(sharded_params, tok)
    hlo = lowered.as_text()
    assert hlo.count('sharding_constraint') >= 3 and '[{"data", "fsdp", "expert"}, {}, {}]' in hlo
    assert tok.sharding.spec == PartitionSpec(("data", "fsdp", "expert"))
    # the MoE layers are expert parallel (a replicated MoE would compute the same numbers):
    # each device's tokens go to their experts' owners and back, forward and backward
    compiled = lowered.compile().as_text()
    assert compiled.count("all-to-all(") >= 4 * TINY.n_moe_layers
    np.testing.assert_allclose(out8.logits, out1.logits, atol=1e-5)
    np.testing.assert_array_equal(out8.routed_experts, out1.routed_experts)
    np.testing.assert_allclose(l8, l1, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g8), jax.tree_util.tree_leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    g_wi = g8["layers_1"]["moe"]["wi_up"]
    assert addressable_shard_shapes(g_wi) == [(2, 64, 32)] * 8
    assert np.abs(np.asarray(g_wi)).max() > 0


def test_chunked_attention_on_the_mesh_matches_one_device(mesh, sharded_params, tiny_params,
                                                          tokens, jit):
    """Query chunks (12 tokens in chunks of 5) inside the sharded step: same loss and
    gradients as the unchunked model on one device."""
    chunked = TINY.replace(attention_chunk=5)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (l1, _), g1 = jit(grad_fn)(tiny_params, tokens)
    step = jit(jax.value_and_grad(lambda p, t: loss_fn(p, t, chunked), has_aux=True),
               out_shardings=((None, None), sharding.param_shardings(TINY, mesh)))
    with sharding.activation_sharding(mesh):
        (l8, _), g8 = step(sharded_params, jax.device_put(tokens, sharding.batch_sharding(mesh)))
    np.testing.assert_allclose(l8, l1, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g8), jax.tree_util.tree_leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
