"""Scanned layers (`model.scan_layers`, espo_jax/models/scan.py): the runs each architecture is
cut into, outputs and gradients equal to the per-layer loop on every family, the two parameter
layouts converting exactly, and every reader of weights by layer (the engine, the Hugging Face
export, the published rollout weights, the sigmoid router's bias update) given the scanned
layout."""

import filecmp
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax import mesh_rules, sharding
from espo_jax.models import forward, get_preset, hf_io, init_cache, init_params, router, scan
from espo_jax.rollout.decode import engine_params
from espo_jax.train.async_loop import rollout_weights

_QWEN35 = get_preset("tiny_qwen35_moe")
# Each family's tiny preset, deep enough for a scanned run of >= 2 repeats: Qwen3-MoE with
# dense and MoE layers alternating (a cycle of 2); DeepSeek-V3 (MLA, the sigmoid router and its
# bias, a shared expert: a dense first layer, then a run of MoE layers); Qwen3.5 (Gated
# DeltaNet and a gated shared expert: a linear-attention layer and a full one, a cycle of 2,
# twice; the real model's cycle of 4 in the layouts test). GLM-4.5 and Qwen3-Next are built of
# the same layer kinds (`test_runs_of_each_architecture` cuts GLM-4.5-Air).
FAMILIES = {
    "qwen3_moe": get_preset("tiny", n_layers=4, moe_every=2),
    "deepseek_v3": get_preset("tiny_deepseek_v3", n_layers=4),
    "qwen35_moe": _QWEN35.replace(layer_types=("linear_attention", "full_attention") * 2),
}
QWEN35_CYCLES = _QWEN35.replace(n_layers=8, layer_types=_QWEN35.layer_types * 2)
B, T = 2, 9
U = 2.0 ** -24  # fp32 unit roundoff


def _runs(config):
    return [(r.start, r.period, r.repeats) for r in scan.runs(config.replace(scan_layers=True))]


def test_runs_of_each_architecture():
    # all 48 layers MoE; 3 dense then 58 MoE; 1 dense then 45 MoE; (3 linear + 1 full) x 10
    assert _runs(get_preset("qwen3_30b_a3b")) == [(0, 1, 48)]
    assert _runs(get_preset("deepseek_v3")) == [(0, 1, 3), (3, 1, 58)]
    assert _runs(get_preset("glm45_air")) == [(0, 1, 1), (1, 1, 45)]
    assert _runs(get_preset("qwen35_35b_a3b")) == [(0, 4, 10)]
    # linear, linear, linear, full: the three repeat, the last layer stands alone
    assert _runs(_QWEN35) == [(0, 1, 3), (3, 1, 1)]
    assert _runs(FAMILIES["qwen3_moe"]) == [(0, 2, 2)]  # dense, MoE, dense, MoE
    assert _runs(FAMILIES["qwen35_moe"]) == [(0, 2, 2)]
    assert _runs(QWEN35_CYCLES) == [(0, 4, 2)]
    # off: one run per layer, the per-layer names
    assert [r.name for r in scan.runs(FAMILIES["deepseek_v3"])] == [
        f"layers_{i}" for i in range(4)]


def _init(config):
    return jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))


def _inputs(config):
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, config.vocab_size)
    # replay k distinct random experts per token and MoE layer, the sentinel -1 (route
    # normally) on 3 tokens
    scores = jax.random.uniform(jax.random.key(2), (B, T, config.n_moe_layers, config.n_experts))
    replay = jnp.argsort(scores, axis=-1)[..., :config.top_k].astype(jnp.int32)
    return tokens, _init(config), replay.at[1, :3].set(-1)


def _loss_and_grads(config, params, tokens, replay):
    def loss(p):
        out = forward(config, p, tokens, routed_experts_BxTxMxk=replay)
        logp = jax.nn.log_softmax(out.logits)
        nll = -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1))
        return nll + out.aux_loss, out

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scanned_layers_equal_the_loop(family):
    config = FAMILIES[family]
    scanned = config.replace(scan_layers=True)
    tokens, params, replay = _inputs(config)
    (loss, out), grads = _loss_and_grads(config, params, tokens, replay)
    (loss_s, out_s), grads_s = _loss_and_grads(scanned, scan.stack(scanned, params), tokens,
                                               replay)
    assert scan.is_scanned(grads_s)
    # Both programs apply the same operations to the same numbers; only XLA's fusion (and so
    # the rounding of each operation) may differ. A length-n fp32 dot product is within n u of
    # its terms' magnitude (Higham, gamma_n); an error made in a layer passes through the ones
    # after it: L n u of the largest value, n the longest reduction (d_ff, experts' widths and
    # the model dimension), twice that for the backward pass.
    n = max(config.d_model, config.d_ff, config.d_expert, config.n_heads * config.head_dim)
    bound = config.n_layers * n * U
    np.testing.assert_allclose(out_s.logits, out.logits, rtol=0,
                               atol=bound * float(jnp.max(jnp.abs(out.logits))))
    np.testing.assert_array_equal(out_s.routed_experts, out.routed_experts)
    np.testing.assert_array_equal(out_s.own_experts, out.own_experts)
    assert abs(float(loss_s) - float(loss)) <= bound * abs(float(loss))
    for k in out.metrics:
        np.testing.assert_allclose(out_s.metrics[k], out.metrics[k], rtol=bound, atol=1e-12)
    flat_s = jax.tree_util.tree_leaves_with_path(scan.unstack(grads_s))
    flat = dict(jax.tree_util.tree_leaves_with_path(grads))
    assert len(flat_s) == len(flat)
    for path, g_s in flat_s:
        g = flat[path]
        np.testing.assert_allclose(g_s, g, rtol=0, atol=2 * bound * float(jnp.max(jnp.abs(g))),
                                   err_msg=jax.tree_util.keystr(path))


def test_layouts_convert_exactly():
    config = QWEN35_CYCLES
    scanned = config.replace(scan_layers=True)
    params = _init(config)
    stacked = scan.stack(scanned, params)
    assert sorted(stacked) == ["embed", "final_norm", "lm_head", "scan_0_8"]
    assert sorted(stacked["scan_0_8"]) == [f"layer_{q}" for q in range(4)]
    # layer 6 is the third block of the second repeat
    assert scan.locate(scanned, 6) == (("scan_0_8", "layer_2"), 1)
    np.testing.assert_array_equal(stacked["scan_0_8"]["layer_2"]["mlp_norm"]["scale"][1],
                                  params["layers_6"]["mlp_norm"]["scale"])
    back = scan.unstack(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, params))
    # a scanned model initialises straight into its layout
    fresh = jax.eval_shape(lambda: init_params(scanned, jax.random.key(0)))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), fresh) == jax.tree.map(
        lambda x: (x.shape, x.dtype), stacked)
    # host (numpy) weights stay on the host; converting twice changes nothing
    host = scan.stack(scanned, jax.tree.map(np.asarray, params))
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    assert scan.stack(scanned, host) is host and scan.unstack(params) is params


def test_weight_decay_is_the_loop_layouts():
    """AdamW decays a layer's matrices only, whatever the layout: a scanned run's norm scales
    ([repeats, D]) are not matrices. One step at zero gradient is the decay alone, -lr wd p."""
    from espo_jax import configs
    from espo_jax.train.state import make_optimizer

    config = QWEN35_CYCLES
    params = _init(config)
    optim = configs.default_config().optim
    optim.update(lr=0.1, warmup_steps=0, final_lr_frac=1.0, weight_decay=0.5)

    @jax.jit
    def step(p):
        tx = make_optimizer(optim, total_steps=1)
        return tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)[0]

    loop = step(params)
    assert float(jnp.max(jnp.abs(loop["layers_6"]["mlp_norm"]["scale"]))) == 0.0
    np.testing.assert_allclose(loop["layers_7"]["attn"]["o_proj"]["kernel"],
                               -0.05 * params["layers_7"]["attn"]["o_proj"]["kernel"],
                               rtol=1e-6)
    scanned = scan.unstack(step(scan.stack(config.replace(scan_layers=True), params)))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), scanned, loop))


def test_repeats_axis_is_never_split():
    config = get_preset("qwen3_30b_a3b", n_layers=4, scan_layers=True)
    specs = sharding.logical_specs(config)
    assert tuple(specs["scan_0_4"]["layer_0"]["moe"]["wi_gate"]) == (
        "layers", "exp", "embed", "mlp")
    mesh = jax.sharding.AbstractMesh((1, 2, 4, 1), mesh_rules.MESH_AXES)
    got = sharding.logical_to_mesh_shardings(specs, mesh)["scan_0_4"]["layer_0"]["moe"]["wi_gate"]
    assert got.shard_shape((4, 128, 2048, 768)) == (4, 32, 1024, 768)


def test_readers_by_layer_take_the_scanned_layout(tmp_path):
    config = FAMILIES["deepseek_v3"].replace(router_bias_update_rate=0.01)
    scanned = config.replace(scan_layers=True)
    tokens, params, replay = _inputs(config)
    stacked = scan.stack(scanned, params)

    def same(a, b):
        return jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))

    # the engine: weights and config per layer
    for precision in ("fp32", "bf16"):
        (ours, cfg), (want, want_cfg) = (engine_params(stacked, scanned, precision),
                                         engine_params(params, config, precision))
        assert same(ours, want) and cfg == want_cfg and not cfg.scan_layers
    # the rollout weights a learner publishes to its workers
    (cfg, ours), (want_cfg, want) = rollout_weights(scanned, stacked), rollout_weights(config,
                                                                                    params)
    assert same(ours, want) and cfg == want_cfg
    # the Hugging Face export: the same files
    hf_io.save_pretrained(scanned, stacked, str(tmp_path / "scanned"))
    hf_io.save_pretrained(config, params, str(tmp_path / "loop"))
    names = sorted(os.listdir(tmp_path / "loop"))
    assert names == sorted(os.listdir(tmp_path / "scanned"))
    assert filecmp.cmpfiles(tmp_path / "loop", tmp_path / "scanned", names, shallow=False)[0] \
        == names
    # the auxiliary-loss-free bias update moves each layer's bias in its repeat's row
    moved = router.update_router_biases(scanned, stacked, replay)
    want = router.update_router_biases(config, params, replay)
    assert not same(want, params) and same(scan.unstack(moved), want)
    # the scanned layout has no cache: the engine reads the weights per layer
    with pytest.raises(ValueError, match="per-layer layout"):
        forward(scanned, stacked, tokens, cache=init_cache(config, B, 16),
                cache_mask_BxS=jnp.zeros((B, 16), bool))
