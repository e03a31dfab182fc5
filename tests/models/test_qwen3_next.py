"""Qwen3-Next and Qwen3.5-MoE against transformers (fp32, eager attention, CPU; transformers'
torch Gated DeltaNet, `torch_chunk_gated_delta_rule` with chunks of 64, is the reference).

Tiny random models built with transformers' own config classes (both layer types, value heads
grouped over key heads, a dense layer in the Qwen3-Next case), every weight random, are saved
with `save_pretrained`, read with `hf_io.from_pretrained` and compared on 150-token sequences
(three of HF's chunks; ours at chunk 64 and 16): logits and router logits. `hf_io.save_pretrained`
output loads back into transformers with equal logits; greedy decoding through the rollout
engine equals transformers' `generate`.
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
from helpers.fp32 import fp32_bound
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig

from espo_jax.models import forward, hf_io, hf_qwen3_next
from espo_jax.models.flops import param_count

B, T = 2, 150
_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, moe_intermediate_size=16,
               shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
               max_position_embeddings=512,
               layer_types=["linear_attention", "full_attention", "linear_attention",
                            "linear_attention"])
CASES = {
    # decoder_sparse_step 2: layers 1 and 3 MoE, 0 and 2 dense SwiGLU
    "qwen3_next": (Qwen3NextConfig, dict(intermediate_size=40, decoder_sparse_step=2)),
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, dict(tie_word_embeddings=False)),
}


# zero-centred norms around 0, the gated norm around 1; decays exp(g) ~ 0.5 to 0.95
_randomize = functools.partial(
    hf_random.randomize, norm_centre=lambda name: 1.0 if "linear_attn.norm" in name else 0.0,
    rules=((("A_log", "dt_bias"), (0.5, -1.0)),))

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


@functools.cache
def _hf_forward(path: str):
    return hf_random.eager_forward(path, _tokens())


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(root, case):
    path = _hf_dir(case, root)
    config, params = hf_io.from_pretrained(path)
    hf_model, hf_out = _hf_forward(path)
    assert param_count(config) == sum(p.numel() for p in hf_model.parameters()) == sum(
        x.size for x in jax.tree.leaves(params))
    assert config.linear_layers == (0, 2, 3) and config.moe_layers == (
        (1, 3) if case == "qwen3_next" else (0, 1, 2, 3))
    # Two fp32 programs of the same function (helpers/fp32.py): 4 layers x the longest
    # reduction (attention over T = 150 tokens) x eps x max |output|.
    reduction = max(T, _COMMON["hidden_size"], 2 * _COMMON["moe_intermediate_size"])
    ref = hf_out.logits.numpy()
    bound = fp32_bound(_COMMON["num_hidden_layers"], reduction, np.max(np.abs(ref)))
    for chunk in (64, 16):
        out = jax.jit(functools.partial(forward, config.replace(linear_chunk=chunk)))(
            params, _tokens())
        diff = float(np.max(np.abs(np.asarray(out.logits) - ref)))
        print(f"{case} chunk {chunk}: max |logit diff| {diff:.2e} (bound {bound:.2e})")
        assert diff < bound
    for m, r in enumerate(hf_out.router_logits):
        r = r.numpy()
        np.testing.assert_allclose(
            np.asarray(out.router_logits[m]).reshape(B * T, -1), r, rtol=0,
            atol=fp32_bound(_COMMON["num_hidden_layers"], reduction, np.max(np.abs(r))))


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_loads_in_transformers(root, tmp_path, case):
    """The export keeps the family it read (`source_model_type`): a Qwen3.5-MoE model written
    as qwen3_next would not load as Qwen3.5-MoE (fused against split projections)."""
    src = _hf_dir(case, root)
    config, params = hf_io.from_pretrained(src)
    assert hf_io.source_model_type(src) == case
    hf_io.save_pretrained(config, params, str(tmp_path), model_type=case)
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert (written["model_type"], written["architectures"]) == (
        case, [hf_qwen3_next.ARCHITECTURES[case]])
    model, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _, ref = _hf_forward(src)
    with torch.no_grad():
        logits = model(torch.as_tensor(_tokens())).logits
    assert torch.equal(logits, ref.logits)  # same numbers, same code: bitwise equal
    assert type(model).__name__ == hf_qwen3_next.ARCHITECTURES[case]
    back, params2 = hf_io.from_pretrained(str(tmp_path))
    assert back == config.replace(norm_topk_prob=back.norm_topk_prob)
    jax.tree.map(np.testing.assert_array_equal, params, params2)
    # without a source family the hybrid config writes the general qwen3_next; a family that
    # cannot hold the config is refused by name
    hf_io.save_pretrained(config, params, str(tmp_path / "default"))
    with open(tmp_path / "default" / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3_next"
    with pytest.raises(ValueError, match="read as llama would be written as"):
        hf_io.save_pretrained(config, params, str(tmp_path / "x"), model_type="llama")
    if case == "qwen3_next":  # its dense layers (decoder_sparse_step 2): not Qwen3.5-MoE's
        with pytest.raises(ValueError, match="qwen3_5_moe_text needs every layer MoE"):
            hf_io.save_pretrained(config.replace(moe_every=2), params, str(tmp_path / "y"),
                                  model_type="qwen3_5_moe_text")


def test_multimodal_config_mtp_and_vision_skipped(root, tmp_path, caplog):
    """A `qwen3_5_moe` checkpoint (text model under text_config, tensors under
    model.language_model.) reads as its text model; mtp.* and model.visual.* are skipped with a
    log line; any other unknown tensor is refused."""
    src = _hf_dir("qwen3_5_moe_text", root)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    moved = {("model.language_model." + n[6:] if n.startswith("model.") else n): x
             for n, x in tensors.items()}
    extra = {"mtp.fc.weight": np.ones((4, 4), np.float32),
             "model.visual.patch_embed.proj.weight": np.ones((4, 4), np.float32)}
    save_file(moved | extra, str(tmp_path / "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    top = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(top))
    with caplog.at_level(logging.INFO, logger="espo_jax.models.hf_io"):
        config, params = hf_io.from_pretrained(str(tmp_path))
    assert "skipped 2 multi-token-prediction / vision tensors" in caplog.text
    ref_config, ref_params = hf_io.from_pretrained(src)
    assert config == ref_config
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)
    save_file(moved | {"model.language_model.layers.0.odd.weight": np.ones(2, np.float32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="1 tensors the model does not use"):
        hf_io.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("attention_bias", True),
                                          ("layer_types", ["linear_attention", "sliding"] * 2)])
def test_unsupported_fields_are_refused_by_name(root, field, value):
    with open(os.path.join(_hf_dir("qwen3_next", root), "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match=field):
        hf_io.config_from_hf(hf | {field: value})
