"""Expert-parallel MoE (`models.moe_ep`) on 8 fake CPU devices: the loss and gradients of a
sequence log-likelihood with the MoE aux loss, with recorded routing replayed (R3) and with the
model's own, equal the single-device model's in fp32 on meshes data 2 x expert 4 and fsdp 2 x
expert 4, for Qwen3-MoE, the DeepSeek-V3 tiny (sigmoid group router, shared expert, dense first
layer) and the Qwen3.5 tiny hybrid; the compiled step exchanges tokens with all-to-alls (two
per MoE layer forward) and never gathers the mesh's tokens in one place."""

import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from espo_jax import mesh_rules, sharding
from espo_jax.models import get_preset, init_params
from espo_jax.train.step import sequence_logprobs

B, T = 8, 14  # 8 x 13 = 104 input tokens: one row per device on either mesh
FAMILIES = ("tiny", "tiny_deepseek_v3", "tiny_qwen35_moe")
MESHES = {"data2_expert4": (2, 1, 4, 1), "fsdp2_expert4": (1, 2, 4, 1)}


def _loss(config, params, tokens, routed):
    positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
    logp, _, out = sequence_logprobs(config, params, tokens[:, :-1], positions[:, :-1],
                                     tokens[:, 1:], routed, chunk_size=8)
    return -jnp.mean(logp) + out.aux_loss


def _inputs(config):
    r = np.random.default_rng(0)
    tokens = jnp.asarray(r.integers(0, config.vocab_size, (B, T)), jnp.int32)
    # distinct experts per token and layer; the last layer's routes also skewed to expert 0-1
    routed = np.stack([np.stack([r.permutation(config.n_experts)[:config.top_k]
                                 for _ in range(config.n_moe_layers)]) for _ in range(B * T)])
    routed = routed.reshape(B, T, config.n_moe_layers, config.top_k)[:, :-1]
    routed[:, :, -1, 0] = r.integers(0, 2, routed.shape[:2])
    routed[:, :, -1, 1] = np.where(routed[:, :, -1, 0] == 0, 1, 0)
    return tokens, jnp.asarray(routed, jnp.int32)


@functools.cache
def _single(family, replay):
    config = get_preset(family)
    params = init_params(config, jax.random.key(0))
    tokens, routed = _inputs(config)
    grad = jax.jit(jax.value_and_grad(functools.partial(_loss, config)))
    loss, grads = grad(params, tokens, routed if replay else None)
    return config, params, float(loss), jax.device_get(grads)


def _mesh(name):
    data, fsdp, expert, tensor = MESHES[name]
    cfg = ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, expert=expert, tensor=tensor,
                                         rules=mesh_rules.DEFAULT_RULES))
    return sharding.make_mesh(cfg, jax.devices()[:8])


def _sharded(family, mesh_name, replay, **fields):
    config, params, _, _ = _single(family, replay)
    config = config.replace(**fields)
    mesh = _mesh(mesh_name)
    params = jax.device_put(params, sharding.param_shardings(config, mesh))
    tokens, routed = jax.device_put(_inputs(config), sharding.batch_sharding(mesh))
    args = (params, tokens, routed if replay else None)
    with sharding.activation_sharding(mesh):
        compiled = jax.jit(jax.value_and_grad(functools.partial(_loss, config))).lower(
            *args).compile()
    loss, grads = compiled(*args)
    return config, compiled.as_text(), float(loss), jax.device_get(grads)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py)")
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_equals_one_device(family, mesh_name):
    for replay in (True, False) if family == "tiny" else (True,):
        _, _, want_loss, want = _single(family, replay)
        config, hlo, loss, grads = _sharded(family, mesh_name, replay)
        assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
        flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
        for (path, g), w in zip(flat_want, jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(w, g, atol=1e-5, rtol=1e-5,
                                       err_msg=jax.tree_util.keystr(path))
    # Two token all-to-alls (there and back) per MoE layer forward, their transposes backward:
    # the CPU stand-in's buffers, one [1, slot, D] block per expert-group device (slot = a
    # device's assignments, 13 x top-2).
    d, slot = config.d_model, (T - 1) * config.top_k
    moved = [line for line in hlo.splitlines() if re.match(r"\s*%all-to-all", line)
             and f"f32[1,{slot},{d}]" in line]
    assert len(moved) == 4 * config.n_moe_layers, len(moved)
    # Nothing gathers the mesh's tokens (104, or their 208 assignments; no weight has such a
    # dimension) on one device: the global dispatch gathered the router logits [104, E] for
    # its top-k and the assignments [208] for its sort.
    gathered = re.findall(r"= \(?\w+\[([\d,]*)\][^ ]* all-gather\(", hlo)
    tokens = {B * (T - 1), B * (T - 1) * config.top_k}
    assert not [s for s in gathered if tokens & {int(x) for x in s.split(",") if x}], gathered


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py)")
def test_chunked_exchange_equals_one_device_with_smaller_buffers():
    """`ep_chunk` 5 over a device's 13 tokens: three exchanges of 5 tokens (the last with 2
    padding tokens that go nowhere), each buffer 5 x top-2 = 10 rows per source, not 26; the
    loss and gradients still equal the single device's (routing replayed and the model's own)."""
    for replay in (True, False):
        _, _, want_loss, want = _single("tiny", replay)
        config, hlo, loss, grads = _sharded("tiny", "fsdp2_expert4", replay, ep_chunk=5)
        assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(w, g, atol=1e-5, rtol=1e-5)
    d = config.d_model
    moved = {int(m) for line in hlo.splitlines() if re.match(r"\s*%all-to-all", line)
             for m in re.findall(r"f32\[1,(\d+)," + str(d) + r"\]", line)}
    assert moved == {5 * config.top_k}, moved
