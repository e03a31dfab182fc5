"""Block-FP8 checkpoints (DeepSeek-V3's format) read by `hf_io.from_pretrained`.

A tiny random transformers Qwen3-MoE model with dimensions past one 128 block and not multiples
of it (160, 200, 136: partial edge blocks) is saved by transformers; the test quantises every
projection weight to E4M3 with 128x128 block scales (`weight_scale_inv`, scale = amax / 448),
as DeepSeek-V3 ships them, leaving the embeddings, norms, router gate and LM head in float. Read
back, every parameter equals the exact dequantisation (each E4M3 value times its block's
scale, computed here block by block) bit for bit, and the logits equal transformers' on those
dequantised weights.
"""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from espo_jax.models import forward, hf_fp8, hf_io

E4M3 = ml_dtypes.float8_e4m3fn
BLOCK = 128
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [BLOCK, BLOCK]}
# q_proj [160, 160] and o_proj: 2x2 blocks, the last 32 wide; k/v_proj [80, 160]; the dense
# MLP of layer 0 [200, 160] / [160, 200]; experts [136, 160] / [160, 136] (fused gate_up
# [272, 160]: 3 block rows, the middle one across the gate/up boundary, the last 16 high).
HF = dict(vocab_size=96, hidden_size=160, intermediate_size=200, moe_intermediate_size=136,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
          rms_norm_eps=1e-6, max_position_embeddings=64,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
TOKENS = np.random.default_rng(0).integers(0, HF["vocab_size"], (2, 12))


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (E4M3 values, float32 scale_inv per 128x128 block), block by block."""
    rows, cols = w.shape
    scale = np.zeros((-(-rows // BLOCK), -(-cols // BLOCK)), np.float32)
    q = np.zeros(w.shape, E4M3)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = np.s_[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = np.abs(w[tile]).max() / np.float32(448)
            q[tile] = (w[tile] / scale[i, j]).astype(E4M3)
    return q, scale


def dequantize_blocks(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Each E4M3 value times its block's scale, in float32, block by block."""
    out = np.zeros(q.shape, np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = np.s_[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            out[tile] = q[tile].astype(np.float32) * scale[i, j]
    return out


def write(path, tensors: dict, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**HF), attn_implementation="eager",
                                             dtype=torch.float32)
    with torch.no_grad():  # every weight random; router weights large (clear top-k margins)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_((1.0 if name.endswith("mlp.gate.weight") else 0.15) * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("float"))
    model.save_pretrained(path)
    return path


def fp8_checkpoint(float_dir: str, fused: bool) -> tuple[dict, dict, dict]:
    """Tensors of the block-FP8 checkpoint, the same dequantised by hand, and config.json
    (without the `quantization_config` the FP8 one has)."""
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    config = json.load(open(os.path.join(float_dir, "config.json")))
    fp8, ref = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight") and ".experts." not in name:
            q, s = quantize_blocks(w)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            ref[name] = dequantize_blocks(q, s)
        elif ".experts." not in name:  # embeddings, norms, router gate, lm_head stay float
            fp8[name] = ref[name] = w
    for i in range(1, HF["num_hidden_layers"]):  # layer 0 is dense
        base = f"model.layers.{i}.mlp.experts"
        per = {p: [tensors[f"{base}.{j}.{p}.weight"] for j in range(HF["num_experts"])]
               for p in ("gate_proj", "up_proj", "down_proj")}
        if fused:  # transformers 5.x layout: [E, 2F, D] and [E, D, F], scales per expert
            gate_up = [np.concatenate(gu) for gu in zip(per["gate_proj"], per["up_proj"],
                                                        strict=True)]
            for fused_name, ws in (("gate_up_proj", gate_up), ("down_proj", per["down_proj"])):
                qs = [quantize_blocks(w) for w in ws]
                fp8[f"{base}.{fused_name}"] = np.stack([q for q, _ in qs])
                fp8[f"{base}.{fused_name}_scale_inv"] = np.stack([s for _, s in qs])
                deq = [dequantize_blocks(q, s) for q, s in qs]
                for j, d in enumerate(deq):
                    if fused_name == "down_proj":
                        ref[f"{base}.{j}.down_proj.weight"] = d
                    else:
                        f = HF["moe_intermediate_size"]
                        ref[f"{base}.{j}.gate_proj.weight"] = d[:f]
                        ref[f"{base}.{j}.up_proj.weight"] = d[f:]
        else:
            for p, ws in per.items():
                for j, w in enumerate(ws):
                    q, s = quantize_blocks(w)
                    name = f"{base}.{j}.{p}.weight"
                    fp8[name], fp8[f"{base}.{j}.{p}.weight_scale_inv"] = q, s
                    ref[name] = dequantize_blocks(q, s)
    return fp8, ref, config


def test_dequantize_partial_blocks_by_hand():
    # 3x3 E4M3 integers (exact in E4M3) in 2x2 blocks: a 2x2 grid whose last row and column
    # are 1 wide. Block (0,0) x 0.5, (0,1) x 2, (1,0) x 4, (1,1) x 0.25.
    q = np.arange(1, 10, dtype=np.float32).reshape(3, 3).astype(E4M3)
    s = np.array([[0.5, 2.0], [4.0, 0.25]], np.float32)
    out = hf_fp8.dequantize("w.weight", q, s, (2, 2))
    np.testing.assert_array_equal(out, [[0.5, 1.0, 6.0], [2.0, 2.5, 12.0], [28.0, 32.0, 2.25]])
    assert out.dtype == np.float32
    with pytest.raises(ValueError, match=r"w.weight_scale_inv is float32 \(2, 2\); weight "
                                         r"\(3, 3\) in 1x2 blocks needs float \(3, 2\)"):
        hf_fp8.dequantize("w.weight", q, s, (1, 2))


@pytest.mark.parametrize("fused", [False, True])
def test_block_fp8_checkpoint_loads_exactly(float_dir, tmp_path, fused):
    fp8, ref, hf_config = fp8_checkpoint(float_dir, fused)
    fp8_dir = write(tmp_path / "fp8", fp8, hf_config | {"quantization_config": QUANT})
    ref_dir = write(tmp_path / "ref", ref, hf_config)
    header = hf_fp8.read_header(os.path.join(fp8_dir, "model.safetensors"))["tensors"]
    down = header["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert header["model.layers.0.mlp.down_proj.weight"]["dtype"] == "F8_E4M3"
    assert (down["dtype"], down["shape"]) == ("F32", [2, 2])  # [160, 200]: 128 + 32, 128 + 72
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in header  # router stays float

    config, params = hf_io.from_pretrained(fp8_dir)
    ref_config, ref_params = hf_io.from_pretrained(ref_dir)
    assert config == ref_config and config.param_dtype == "float32"
    for (path, ours), theirs in zip(jax.tree_util.tree_leaves_with_path(params),
                                    jax.tree.leaves(ref_params), strict=True):
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, theirs, err_msg=jax.tree_util.keystr(path))
    original = load_file(os.path.join(float_dir, "model.safetensors"))
    q_proj = params["layers_0"]["attn"]["q_proj"]["kernel"]
    w = original["model.layers.0.self_attn.q_proj.weight"].T
    err = np.abs(q_proj - w)
    assert 0 < err.max() <= 2.0 ** -4 * np.abs(w).max()  # really E4M3: within half an ulp

    hf = AutoModelForCausalLM.from_pretrained(ref_dir, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.as_tensor(TOKENS)).logits.numpy()
    logits = jax.jit(forward, static_argnums=0)(config, params, TOKENS).logits
    np.testing.assert_allclose(np.asarray(logits), hf_logits, atol=1e-4, rtol=0)


def test_unsupported_quantisation_is_refused_by_name(float_dir, tmp_path):
    tensors, _, config = fp8_checkpoint(float_dir, fused=False)
    config = config | {"quantization_config": QUANT}
    name = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        ({**config, "quantization_config": {"quant_method": "awq"}}, tensors,
         r"quant_method 'awq' is not supported; only 'fp8'"),
        ({**config, "quantization_config": {**QUANT, "activation_scheme": "static",
                                            "fmt": "e5m2"}}, tensors,
         r"fmt='e5m2' \(only 'e4m3'\); activation_scheme='static' \(only 'dynamic'\)"),
        ({**config, "quantization_config": {**QUANT, "weight_block_size": None}}, tensors,
         r"weight_block_size None is not two positive integers"),
        ({k: v for k, v in config.items() if k != "quantization_config"}, tensors,
         rf"{name} is float8_e4m3fn with block scales but config.json has no "
         "quantization_config"),
        (config, {k: v for k, v in tensors.items() if k != name + "_scale_inv"},
         rf"float8_e4m3fn tensor {name} has no scale tensor {name}_scale_inv"),
        (config, {**tensors, name + "_scale_inv": np.ones((1, 2), np.float32)},
         rf"{name}_scale_inv is float32 \(1, 2\); weight \(160, 160\) in 128x128 blocks "
         r"needs float \(2, 2\)"),
    ]
    for i, (cfg, ts, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            hf_io.from_pretrained(write(tmp_path / f"bad{i}", ts, cfg))
