"""Hugging Face interop against real `transformers` models (fp32, eager attention, CPU).

Tiny random Qwen3-MoE / Qwen2-MoE models, and dense Qwen3 / Qwen2 / Llama ones, are built with
a fixed torch seed, saved with transformers' own `save_pretrained`, read with
`hf_io.from_pretrained`, and compared with the transformers forward: logits, the top-k expert
sets per token and MoE layer, and the load-balancing loss. `hf_io.save_pretrained` output is
loaded back by transformers.
"""

import functools
import json
import os

import jax
import numpy as np
import pytest
import torch
from helpers import hf_random
from safetensors import safe_open
from safetensors.numpy import save_file
from safetensors.torch import save_file as torch_save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from espo_jax.models import forward, hf_io, init_params

B, T = 2, 12
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
               num_attention_heads=4, moe_intermediate_size=16, num_experts=6,
               num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=64,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
CASES = {
    # GQA (4 query heads over 2 kv heads), renormalised top-k, separate LM head, all layers MoE.
    "qwen3_gqa_norm": (Qwen3MoeConfig, dict(num_key_value_heads=2, head_dim=12,
                                            norm_topk_prob=True)),
    # MHA, raw top-k probabilities, tied embeddings, layer 0 dense through mlp_only_layers.
    "qwen3_mha_tied": (Qwen3MoeConfig, dict(num_key_value_heads=4, head_dim=8,
                                            norm_topk_prob=False, tie_word_embeddings=True,
                                            mlp_only_layers=[0])),
    # Qwen2-MoE: qkv bias, no q/k norm, shared expert with sigmoid gate, MoE every 2nd layer.
    "qwen2_shared": (Qwen2MoeConfig, dict(num_key_value_heads=2, norm_topk_prob=False,
                                          shared_expert_intermediate_size=24,
                                          decoder_sparse_step=2, qkv_bias=True)),
    # Dense Qwen3: q/k norm, GQA, head_dim apart from hidden / heads.
    "qwen3_dense": (Qwen3Config, dict(num_key_value_heads=2, head_dim=12)),
    # Dense Qwen2: q/k/v bias, no q/k norm.
    "qwen2_dense": (Qwen2Config, dict(num_key_value_heads=2)),
    # Llama as SmolLM2 has it: GQA, tied embeddings, no biases, rope theta 1e5.
    "llama_tied": (LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default",
                                                      "rope_theta": 100000.0})),
}
DENSE_CASES = ("qwen3_dense", "qwen2_dense", "llama_tied")


_randomize = hf_random.randomize

@functools.cache
def _hf_dir(case: str, root: str) -> str:
    cls, overrides = CASES[case]
    common = dict(_COMMON)
    if case in DENSE_CASES:
        for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok"):
            common.pop(key)
    return hf_random.save_random(cls(**(common | overrides)), _randomize, root, case)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


@functools.cache
def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, _COMMON["vocab_size"], (B, T))


def _hf_forward(path: str):
    with open(os.path.join(path, "config.json")) as f:
        dense = json.load(f)["model_type"] in hf_io.DENSE
    return hf_random.eager_forward(path, _tokens(), router_logits=not dense)


@functools.cache
def _jax_forward(config):
    return jax.jit(functools.partial(forward, config))


def _topk_sets(router_logits_NxE: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """Sorted top-k expert ids per token, and the smallest gap between the k-th and (k+1)-th
    router logit (a margin large against fp32 error makes the set comparison meaningful)."""
    order = np.argsort(-router_logits_NxE, axis=-1)
    s = np.sort(router_logits_NxE, axis=-1)[:, ::-1]
    return np.sort(order[:, :k], axis=-1), float(np.min(s[:, k - 1] - s[:, k]))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_routing_match_transformers(root, case):
    path = _hf_dir(case, root)
    config, params = hf_io.from_pretrained(path)
    hf_model, hf_out = _hf_forward(path)
    out = _jax_forward(config)(params, _tokens())

    np.testing.assert_allclose(np.asarray(out.logits), hf_out.logits.numpy(), atol=1e-4, rtol=0)
    if case in DENSE_CASES:
        assert config.n_moe_layers == 0 and out.routed_experts.shape[2] == 0
        return
    hf_router = [r.numpy() for r in hf_out.router_logits]  # per MoE layer, [B*T, E]
    assert len(hf_router) == config.n_moe_layers == len(out.router_logits)
    k = config.top_k
    for m, hf_logits in enumerate(hf_router):
        hf_sets, margin = _topk_sets(hf_logits, k)
        assert margin > 1e-3, f"top-k margin {margin} too small for a meaningful comparison"
        ours = np.sort(np.asarray(out.routed_experts)[:, :, m].reshape(B * T, k), axis=-1)
        np.testing.assert_array_equal(ours, hf_sets, err_msg=f"MoE layer {m}")
        np.testing.assert_allclose(np.asarray(out.router_logits[m]).reshape(B * T, -1),
                                   hf_logits, atol=1e-4, rtol=0)
    if config.n_moe_layers == 1:
        # HF pools f and p over all MoE layers before the product; ours is a per-layer mean.
        # They agree when there is one MoE layer.
        np.testing.assert_allclose(float(out.metrics["moe/load_balance_loss"]),
                                   float(hf_out.aux_loss), rtol=1e-5)


def test_config_mapping(root):
    c2, _ = hf_io.from_pretrained(_hf_dir("qwen2_shared", root))
    # decoder_sparse_step=2 over 2 layers: layer 1 is MoE, layer 0 dense.
    assert (c2.moe_every, c2.moe_layers, c2.shared_expert_d_ff) == (2, (1,), 24)
    assert (c2.qk_norm, c2.qkv_bias, c2.head_dim) == (False, True, 32 // 4)
    c3, params = hf_io.from_pretrained(_hf_dir("qwen3_mha_tied", root))
    # mlp_only_layers=[0] with decoder_sparse_step=1 is the same pattern as moe_every=2.
    assert (c3.moe_every, c3.n_kv_heads, c3.tie_embeddings, c3.norm_topk_prob) == (2, 4, True,
                                                                                   False)
    assert "lm_head" not in params
    # The tree is exactly the model's own: same paths and shapes as init_params.
    expected = jax.eval_shape(functools.partial(init_params, c3), jax.random.key(0))
    assert jax.tree.structure(expected) == jax.tree.structure(params)
    jax.tree.map(lambda e, p: np.testing.assert_equal(e.shape, p.shape), expected, params)


@pytest.mark.parametrize("case", ["qwen3_gqa_norm", "qwen2_shared", *DENSE_CASES])
def test_save_pretrained_loads_in_transformers(root, tmp_path, case):
    src = _hf_dir(case, root)
    config, params = hf_io.from_pretrained(src)
    files = hf_io.save_pretrained(config, params, str(tmp_path))
    assert files == ["model.safetensors", "config.json"]
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    # Per-expert names (vLLM's layout), 6 experts x 3 projections per MoE layer.
    assert ("model.layers.1.mlp.experts.5.down_proj.weight" in names) == (case not in DENSE_CASES)
    assert sum(".mlp.experts." in n for n in names) == 6 * 3 * config.n_moe_layers
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == CASES[case][0].model_type  # the same family
    model, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _, ref = _hf_forward(src)
    with torch.no_grad():
        logits = model(torch.as_tensor(_tokens())).logits
    assert torch.equal(logits, ref.logits)  # same numbers, same code: bitwise equal


def test_sharded_round_trip_is_exact(root, tmp_path):
    config, params = hf_io.from_pretrained(_hf_dir("qwen3_gqa_norm", root))
    files = hf_io.save_pretrained(config, params, str(tmp_path), max_shard_bytes=30_000)
    index = json.loads((tmp_path / hf_io.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(f for f in files if f.startswith("model-"))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    assert index["metadata"]["total_size"] == 4 * n_params  # fp32: 4 bytes per parameter
    config2, params2 = hf_io.from_pretrained(str(tmp_path))
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params, params2)
    # A second save into the same directory replaces the shards instead of mixing with them.
    hf_io.save_pretrained(config, params, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_bfloat16_save_and_load(root, tmp_path):
    config, params = hf_io.from_pretrained(_hf_dir("qwen3_gqa_norm", root))
    hf_io.save_pretrained(config, params, str(tmp_path), dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    c16, p16 = hf_io.from_pretrained(str(tmp_path))
    assert c16.param_dtype == "bfloat16" and p16["embed"]["embedding"].dtype.name == "bfloat16"
    _, p32 = hf_io.from_pretrained(str(tmp_path), dtype="float32")
    w, w32 = params["layers_0"]["moe"]["wo"], p32["layers_0"]["moe"]["wo"]
    # bf16 keeps 8 significant bits: relative rounding error at most 2^-8 = 0.0039.
    assert not np.array_equal(w, w32)
    np.testing.assert_allclose(w32, w, rtol=2**-8, atol=0)


def test_reads_fused_expert_layout(root, tmp_path):
    """transformers 5.x holds experts fused in memory (gate_up_proj [E, 2F, D]); read that too."""
    src = _hf_dir("qwen3_gqa_norm", root)
    model, _ = _hf_forward(src)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    os.makedirs(tmp_path, exist_ok=True)
    torch_save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    _, fused = hf_io.from_pretrained(str(tmp_path))
    _, per_expert = hf_io.from_pretrained(src)
    jax.tree.map(np.testing.assert_array_equal, fused, per_expert)


def _edit_checkpoint(src: str, dst, edit_tensors=None, edit_config=None) -> str:
    os.makedirs(dst, exist_ok=True)
    with safe_open(os.path.join(src, "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads(open(os.path.join(src, "config.json")).read())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def test_clear_errors(root, tmp_path):
    src = _hf_dir("qwen3_gqa_norm", root)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    bad = _edit_checkpoint(src, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"lacks tensor {name}.*layers_1/moe/wi_up"):
        hf_io.from_pretrained(bad)
    bad = _edit_checkpoint(src, tmp_path / "extra",
                           lambda t: t.update({"model.mtp.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match="1 tensors the model does not use.*model.mtp.weight"):
        hf_io.from_pretrained(bad)
    assert hf_io.from_pretrained(bad, strict=False)[0].n_layers == 2

    def wrong_shape(t):
        t["model.norm.weight"] = np.ones(31, np.float32)

    bad = _edit_checkpoint(src, tmp_path / "shape", wrong_shape)
    with pytest.raises(ValueError, match=r"final_norm/scale shape \(31,\); config implies \(32,\)"):
        hf_io.from_pretrained(bad)
    bad = _edit_checkpoint(src, tmp_path / "mistral", edit_config=lambda c: c.update(
        model_type="mistral", architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'"):
        hf_io.from_pretrained(bad)
    llama = _hf_dir("llama_tied", root)
    bad = _edit_checkpoint(llama, tmp_path / "llama3", edit_config=lambda c: c.update(
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}))
    with pytest.raises(ValueError, match="unsupported RoPE scaling.*llama3"):
        hf_io.from_pretrained(bad)
    bad = _edit_checkpoint(llama, tmp_path / "mlpbias", edit_config=lambda c: c.update(
        mlp_bias=True))
    with pytest.raises(ValueError, match="llama with mlp_bias=True is not supported"):
        hf_io.from_pretrained(bad)
    # MoE layers {1, 2} of 4: no `moe_every` gives that pattern.
    bad = _edit_checkpoint(src, tmp_path / "pattern", edit_config=lambda c: c.update(
        num_hidden_layers=4, mlp_only_layers=[0, 3]))
    with pytest.raises(ValueError, match=r"MoE layers \[1, 2\] of 4"):
        hf_io.from_pretrained(bad)
    bad = _edit_checkpoint(src, tmp_path / "noexp",
                           edit_config=lambda c: c.pop("num_local_experts"))
    with pytest.raises(ValueError, match=r"lacks required fields: \['num_experts'\]"):
        hf_io.from_pretrained(bad)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_io.from_pretrained(str(tmp_path / "nowhere"))
    config, params = hf_io.from_pretrained(src)
    with pytest.raises(ValueError, match="q/k norm together with qkv_bias or a shared expert"):
        hf_io.save_pretrained(config.replace(shared_expert_d_ff=8), params, str(tmp_path / "o"))
    with pytest.raises(KeyError, match="params has no entry layers_1/moe/wo"):
        del params["layers_1"]["moe"]["wo"]
        hf_io.save_pretrained(config, params, str(tmp_path / "o"))


def test_shardings_place_each_parameter(root):
    """With `shardings`, every leaf lands on the devices as built; experts split on their axis."""
    src = _hf_dir("qwen3_gqa_norm", root)
    config, host = hf_io.from_pretrained(src)
    mesh = jax.make_mesh((2, 4), ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    P = jax.sharding.PartitionSpec

    def spec(path, _):
        expert = path[-1].key in ("wi_gate", "wi_up", "wo")  # [E=6, ...]: 6 % 2 == 0
        return jax.sharding.NamedSharding(mesh, P("data") if expert else P())

    shardings = jax.tree_util.tree_map_with_path(spec, host)
    _, params = hf_io.from_pretrained(src, shardings=shardings)
    wo = params["layers_0"]["moe"]["wo"]
    assert wo.sharding == shardings["layers_0"]["moe"]["wo"]
    assert {s.data.shape for s in wo.addressable_shards} == {(3, 16, 32)}  # 6 experts / 2
    jax.tree.map(np.testing.assert_array_equal, params, host)


def test_quantised_params_are_refused(root, tmp_path):
    from espo_jax.models import quant

    config, params = hf_io.from_pretrained(_hf_dir("qwen3_gqa_norm", root))
    q_proj = params["layers_0"]["attn"]["q_proj"]
    q_proj["kernel"] = quant.quantize_kernel(q_proj["kernel"])  # what quantize_params makes
    with pytest.raises(ValueError, match="layers_0/attn/q_proj/kernel is a quantised kernel"):
        hf_io.save_pretrained(config, params, str(tmp_path))
