"""DeepSeek-V3 and GLM-4.5 against transformers (fp32, eager attention, CPU).

Tiny random `deepseek_v3` / `glm4_moe` models, built with transformers' own config classes and a
fixed torch seed, every weight random and the correction bias non-zero, are saved with
transformers' `save_pretrained`, read with `hf_io.from_pretrained` and compared with the
transformers forward on sequences longer than YaRN's original context: logits, router logits
and the experts chosen. The cases between them exercise n_group > 1 with topk_group < n_group,
shared experts (1 and 2), dense first layers (0 and 1), q_lora_rank set and none, YaRN (both
attention-factor rules) and plain RoPE, interleaved and half-rotated RoPE, partial rotary, q/k
norm and q/k/v bias. `hf_io.save_pretrained` output loads back into transformers.
"""

import functools
import json
import logging
import os

import jax
import numpy as np
import pytest
import torch
from helpers import hf_random
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

from espo_jax.models import forward, hf_io, init_params, router
from espo_jax.models.flops import param_count

B, T = 2, 20  # T past the YaRN cases' original_max_position_embeddings (8)
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
               num_attention_heads=4, moe_intermediate_size=16, n_routed_experts=8,
               rms_norm_eps=1e-6, max_position_embeddings=64)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
             original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0)
CASES = {
    # DeepSeek-V3 as published: q low rank, interleaved YaRN RoPE with mscale == mscale_all_dim
    # (cos/sin factor 1, softmax scale times mscale^2), 4 groups of 2 searched 2 at a time,
    # one shared expert, one dense first layer, renormalised gates scaled by 2.5.
    "dsv3_lora_yarn": (DeepseekV3Config, dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=10, v_head_dim=12, n_group=4, topk_group=2, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=True,
        rope_parameters=_YARN | dict(mscale=1.0, mscale_all_dim=1.0))),
    # No q low rank, half-rotated RoPE, YaRN with the cos/sin factor 0.1 ln(8) + 1 and no
    # softmax correction, one group, raw gates, two shared experts, no dense layer, tied.
    "dsv3_nolora": (DeepseekV3Config, dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=6,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0,
        norm_topk_prob=False, rope_interleave=False, tie_word_embeddings=True,
        rope_parameters=dict(_YARN))),
    # GLM-4.5: GQA with half the head rotated, q/k norm and q/k/v bias, 2 groups of 4 searched
    # 1 at a time, a shared expert, one dense first layer.
    "glm_qknorm_bias": (Glm4MoeConfig, dict(
        num_key_value_heads=2, head_dim=12, use_qk_norm=True, attention_bias=True,
        n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=0.5))),
    # GLM-4.5-Air style without q/k norm or bias, YaRN over a quarter-rotated head.
    "glm_yarn": (Glm4MoeConfig, dict(
        num_key_value_heads=1, head_dim=16, use_qk_norm=False, attention_bias=False,
        n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=True,
        rope_parameters=_YARN | dict(partial_rotary_factor=0.25))),
}


# a correction bias of the scores' own size, so it changes which experts are chosen
_randomize = functools.partial(hf_random.randomize,
                               rules=((("e_score_correction_bias",), (0.3, 0.0)),))

@functools.cache
def _hf_dir(case: str, root: str) -> str:
    cls, overrides = CASES[case]
    return hf_random.save_random(cls(**(_COMMON | overrides)), _randomize, root, case)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


@functools.cache
def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, _COMMON["vocab_size"], (B, T))


def _hf_forward(path: str):
    return hf_random.eager_forward(path, _tokens())


def _choice(logits_NxE, bias_E, config, groups: bool):
    """Sorted experts of the sigmoid group-limited rule in numpy (groups=False: no group limit)."""
    choice = 1 / (1 + np.exp(-logits_NxE)) + bias_E
    n, e = choice.shape
    if groups and config.n_group > 1:
        g = choice.reshape(n, config.n_group, -1)
        top2 = np.sort(g, axis=-1)[..., -2:].sum(-1)
        best = np.argsort(-top2, axis=-1)[:, :config.topk_group]
        keep = np.zeros((n, config.n_group), bool)
        np.put_along_axis(keep, best, True, axis=1)
        choice = np.where(np.repeat(keep, e // config.n_group, axis=1), choice, -np.inf)
    return np.sort(np.argsort(-choice, axis=-1)[:, :config.top_k], axis=-1)


@functools.cache
def _jax_forward(config):
    return jax.jit(functools.partial(forward, config))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_routing_match_transformers(root, case):
    path = _hf_dir(case, root)
    config, params = hf_io.from_pretrained(path)
    hf_model, hf_out = _hf_forward(path)
    out = _jax_forward(config)(params, _tokens())
    # parameter count: transformers' parameters plus the correction-bias buffers
    n_hf = sum(p.numel() for p in hf_model.parameters()) + config.n_moe_layers * 8
    assert param_count(config) == n_hf == sum(x.size for x in jax.tree.leaves(params))
    diff = float(np.max(np.abs(np.asarray(out.logits) - hf_out.logits.numpy())))
    print(f"{case}: max |logit diff| {diff:.2e}")
    assert diff < 1e-4

    first_k = CASES[case][1]["first_k_dense_replace"]
    assert config.moe_layers == tuple(range(first_k, 3))
    hf_router = [r.numpy() for r in hf_out.router_logits]  # per MoE layer, [B*T, E]
    assert len(hf_router) == config.n_moe_layers == out.routed_experts.shape[2]
    bias_changes = groups_change = 0
    for m, i in enumerate(config.moe_layers):
        bias = params[f"layers_{i}"]["moe"]["router"]["e_score_correction_bias"]
        np.testing.assert_allclose(np.asarray(out.router_logits[m]).reshape(B * T, -1),
                                   hf_router[m], atol=1e-4, rtol=0)
        ours = np.sort(np.asarray(out.routed_experts)[:, :, m].reshape(B * T, -1), axis=-1)
        np.testing.assert_array_equal(ours, _choice(hf_router[m], bias, config, True))
        np.testing.assert_array_equal(out.own_experts, out.routed_experts)
        bias_changes += np.sum(np.any(ours != _choice(hf_router[m], 0 * bias, config, True), -1))
        groups_change += np.sum(np.any(ours != _choice(hf_router[m], bias, config, False), -1))
    assert bias_changes > 0  # the correction bias is exercised
    assert (groups_change > 0) == (config.topk_group < config.n_group)


def test_config_mapping(root):
    c, params = hf_io.from_pretrained(_hf_dir("dsv3_lora_yarn", root))
    assert (c.attention, c.router, c.q_lora_rank, c.kv_lora_rank, c.rope_interleave) == (
        "mla", "sigmoid_group", 24, 16, True)
    assert (c.rope_scaling, c.rope_factor, c.rope_original_max_len, c.yarn_mscale_all_dim) == (
        "yarn", 8.0, 8, 1.0)
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.first_k_dense) == (4, 2, 2.5, 1)
    g, _ = hf_io.from_pretrained(_hf_dir("glm_qknorm_bias", root))
    assert (g.attention, g.qk_norm, g.qkv_bias, g.rotary_dim, g.n_kv_heads) == (
        "gqa", True, True, 6, 2)
    for case in ("dsv3_lora_yarn", "dsv3_nolora", "glm_yarn"):
        c, params = hf_io.from_pretrained(_hf_dir(case, root))
        expected = jax.eval_shape(functools.partial(init_params, c), jax.random.key(0))
        assert jax.tree.structure(expected) == jax.tree.structure(params)
        jax.tree.map(lambda e, p: np.testing.assert_equal(e.shape, p.shape), expected, params)


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_loads_in_transformers(root, tmp_path, case):
    src = _hf_dir(case, root)
    config, params = hf_io.from_pretrained(src)
    hf_io.save_pretrained(config, params, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == CASES[case][0].model_type
    model, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _, ref = _hf_forward(src)
    with torch.no_grad():
        logits = model(torch.as_tensor(_tokens())).logits
    assert torch.equal(logits, ref.logits)  # same numbers, same code: bitwise equal
    assert hf_io.from_pretrained(str(tmp_path))[0] == config


def test_mtp_layers_are_skipped_and_unknown_tensors_refused(root, tmp_path, caplog):
    src = _hf_dir("dsv3_lora_yarn", root)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    extra = {"model.layers.3.eh_proj.weight": np.ones((32, 64), np.float32),
             "model.layers.3.self_attn.kv_b_proj.weight": np.ones((4, 4), np.float32)}
    save_file(tensors | extra, str(tmp_path / "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    for n_mtp, ok in ((1, True), (0, False)):
        (tmp_path / "config.json").write_text(json.dumps(hf | {"num_nextn_predict_layers": n_mtp}))
        if ok:
            with caplog.at_level(logging.INFO, logger="espo_jax.models.hf_io"):
                config, _ = hf_io.from_pretrained(str(tmp_path))
            assert config.n_layers == 3 and "skipped 2 tensors of 1 multi-token" in caplog.text
        else:
            with pytest.raises(ValueError, match="2 tensors the model does not use"):
                hf_io.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("field, value", [("scoring_func", "softmax"), ("hidden_act", "gelu"),
                                          ("attention_bias", True), ("topk_method", "greedy"),
                                          ("num_key_value_heads", 2)])
def test_unsupported_fields_are_refused_by_name(root, field, value):
    with open(os.path.join(_hf_dir("dsv3_nolora", root), "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match=field):
        hf_io.config_from_hf(hf | {field: value})
    with pytest.raises(ValueError, match="longrope"):
        hf_io.config_from_hf(hf | {"rope_parameters": {"rope_type": "longrope"}})


def test_own_routing_is_the_kind_choice_not_raw_top_k(root):
    """The learner's own routing (mismatch metrics) is the sigmoid group-limited choice; top-k
    of the raw logits would differ on this model (bias and groups move the choice)."""
    config, params = hf_io.from_pretrained(_hf_dir("dsv3_lora_yarn", root))
    out = _jax_forward(config)(params, _tokens())
    logits = np.stack([np.asarray(x) for x in out.router_logits], axis=2)
    raw = np.sort(np.argsort(-logits, axis=-1)[..., :config.top_k], axis=-1)
    own = np.sort(np.asarray(out.own_experts), axis=-1)
    assert np.any(raw != own)
    assert float(router.routing_flip_rate(out.own_experts, out.routed_experts).max()) == 0.0
