"""The embedded engine on DeepSeek-V3 (MLA, latent cache) and GLM-4.5 (GQA, partial rotary):
greedy decoding equals transformers' `generate` token for token on tiny random models, the
captured routing covers the MoE layers only and equals the learner's own routing of the same
sequence, and MLA's cache holds the latent and rope key per token, not the heads."""

import functools

import jax
import numpy as np
import pytest
import torch
from helpers.hf_random import assert_greedy_is_generate
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

from espo_jax import models
from espo_jax.models import hf_io
from espo_jax.rollout import engine as engine_lib
from espo_jax.rollout.sampling import SamplingConfig

NEW = 8
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
               num_attention_heads=4, moe_intermediate_size=16, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
               max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILIES = {
    "deepseek_v3": (DeepseekV3Config, dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=10, v_head_dim=12, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_interleave=True, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=8,
            mscale=1.0, mscale_all_dim=1.0))),
    "glm4_moe": (Glm4MoeConfig, dict(
        num_key_value_heads=2, head_dim=12, use_qk_norm=True, attention_bias=True, n_group=2,
        topk_group=1, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                           partial_rotary_factor=0.5))),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    cls, overrides = FAMILIES[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**(_COMMON | overrides)),
                                             attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight")
                    else (torch.randn_like(p) if name.endswith("mlp.gate.weight")
                          else 0.3 * torch.randn_like(p)))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn_like(buf))
    model.eval()
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    config, params = hf_io.from_pretrained(path)
    return model, config, params


def _prompts(config):
    rng = np.random.default_rng(1)
    return [engine_lib.Request(f"p{i}", rng.integers(0, config.vocab_size, 6).tolist())
            for i in range(3)]


@functools.cache
def _forward(config):
    return jax.jit(functools.partial(models.forward, config))


def test_greedy_equals_transformers_generate(family):
    model, config, params = family
    engine = engine_lib.Engine(config, params, sampling=SamplingConfig(temperature=0.0,
                                                                       max_new_tokens=NEW),
                               max_slots=2, max_cache_len=32, steps_per_sync=4)
    groups = engine.generate_groups(_prompts(config), n_samples=1)
    assert_greedy_is_generate(model, config, params, groups, NEW, _forward(config))


def test_mla_cache_holds_latent_and_rope_key(family):
    _, config, _ = family
    cache = models.init_cache(config, 2, 32)
    layer = cache["layers_0"]
    if config.attention == "mla":
        assert {k: v.shape for k, v in layer.items()} == {"latent": (2, 32, 16),
                                                          "k_rope": (2, 32, 8)}
        per_token = sum(v.size for v in layer.values()) // (2 * 32)
        assert per_token == 16 + 8  # against 4 heads * (10 + 8 + 12) = 120 expanded
    else:
        assert layer["v"].shape == (2, 2, 32, 12)


def test_cached_decode_equals_full_forward(family):
    """Prefill of 6 tokens into the cache, then 3 single-token steps: the logits of the full
    forward at those positions."""
    _, config, params = family
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (1, 9))
    full = _forward(config)(params, tokens).logits
    cache = models.init_cache(config, 1, 16)
    mask = np.zeros((1, 16), bool)
    out = _forward(config)(params, tokens[:, :6], cache=cache, cache_mask_BxS=mask)
    np.testing.assert_allclose(out.logits, full[:, :6], atol=1e-5)
    cache, mask[:, :6] = out.cache, True
    for t in range(6, 9):
        out = _forward(config)(params, tokens[:, t:t + 1], positions_BxT=np.array([[t]]),
                               cache=cache, cache_mask_BxS=mask)
        np.testing.assert_allclose(out.logits[:, 0], full[:, t], atol=1e-5)
        cache, mask[:, t] = out.cache, True


def _dot_shapes(jaxpr):
    """The output shapes of every matrix product in `jaxpr` and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield tuple(eqn.outvars[0].aval.shape)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _dot_shapes(inner)


@pytest.mark.parametrize("family", ["deepseek_v3"], indirect=True)  # GLM-4.5 is GQA, no latents
def test_mla_decode_step_never_expands_the_cached_latents(family):
    """A decode step absorbs kv_b_proj: no product maps the S cached latents to the heads' keys
    and values ([B * S, C] x [C, H * (P + Dv)]), which a pass of several tokens does."""
    _, config, params = family
    assert config.attention == "mla"
    b, s = 2, 64
    expanded = (b * s, config.n_heads * (config.qk_nope_head_dim + config.v_head_dim))
    cache, mask = models.init_cache(config, b, s), np.zeros((b, s), bool)

    def shapes(t):
        fn = functools.partial(models.forward, config, cache=cache, cache_mask_BxS=mask)
        tokens = np.zeros((b, t), np.int32)
        positions = np.broadcast_to(np.arange(t), (b, t))
        return set(_dot_shapes(jax.make_jaxpr(fn)(params, tokens, positions_BxT=positions).jaxpr))

    assert expanded in shapes(4)
    assert expanded not in shapes(1)
