"""config.json <-> `ModelConfig`: the Qwen3-MoE / Qwen2-MoE families and the dense ones beside
them (Qwen3, Qwen2, Llama) here, DeepSeek-V3 and GLM-4.5 in `hf_deepseek`. `hf_io` reads and
writes the tensors."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from espo_jax.models import hf_deepseek, hf_qwen3_next
from espo_jax.models.config import ModelConfig

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "llama": "LlamaForCausalLM"} | hf_deepseek.ARCHITECTURES | (
                     hf_qwen3_next.ARCHITECTURES)
DENSE = ("qwen3", "qwen2", "llama")
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size")
_REQUIRED_MOE = ("num_experts_per_tok", "moe_intermediate_size")


# ---- config.json <-> ModelConfig -------------------------------------------------------------
def checkpoint_dtype(hf: dict[str, Any]) -> str:
    """The dtype a config.json names (`dtype`, or the older `torch_dtype`) where it is one of
    float32, bfloat16, float16; float32 otherwise or when it names none. Every family's reader
    takes its default from here."""
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return dtype if dtype in _NP_DTYPES else "float32"


def config_from_hf(hf: dict[str, Any], *, dtype: str | None = None) -> ModelConfig:
    """A `ModelConfig` from a parsed Hugging Face `config.json` (one of `ARCHITECTURES`)."""
    hf = hf_qwen3_next.text_config(hf)  # a multimodal Qwen3.5-MoE: its text model
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r} (architectures "
                         f"{hf.get('architectures')}); supported: {sorted(ARCHITECTURES)}")
    dtype = checkpoint_dtype(hf) if dtype is None else dtype
    if model_type in hf_deepseek.ARCHITECTURES or model_type in hf_qwen3_next.ARCHITECTURES:
        family = hf_deepseek if model_type in hf_deepseek.ARCHITECTURES else hf_qwen3_next
        return family.config_from_hf(hf, dtype)
    dense = model_type in DENSE
    missing = [k for k in _REQUIRED + (() if dense else _REQUIRED_MOE) if k not in hf]
    n_experts = 0 if dense else hf.get("num_experts", hf.get("num_local_experts"))
    if n_experts is None:
        missing.append("num_experts")
    if missing:
        raise ValueError(f"config.json ({model_type}) lacks required fields: {missing}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' (SwiGLU)")
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported (full attention only)")
    if hf.get("mlp_bias", False):
        raise ValueError(f"{model_type} with mlp_bias=True is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"unsupported RoPE scaling {rope}; only the default RoPE")
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    qk_norm = model_type in ("qwen3_moe", "qwen3")
    if model_type in ("qwen3_moe", "qwen3", "llama") and hf.get("attention_bias", False):
        raise ValueError(f"{model_type} with attention_bias=True (bias on o_proj) is not "
                         "supported")
    # Qwen2 / Qwen2-MoE always have q/k/v biases (their modules take no flag for it).
    qkv_bias = model_type in ("qwen2_moe", "qwen2") and bool(hf.get("qkv_bias", True))
    n_layers, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    step = hf.get("decoder_sparse_step", 1)
    mlp_only = set(hf.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(n_layers)
                       if i not in mlp_only and n_experts > 0 and (i + 1) % step == 0)
    moe_every = _moe_every_for(moe_layers, n_layers)
    shared = hf.get("shared_expert_intermediate_size", 5632) if model_type == "qwen2_moe" else 0
    moe_fields = {} if dense else dict(
        n_experts=max(n_experts, 1), top_k=hf["num_experts_per_tok"],
        d_expert=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_ff=hf["intermediate_size"], moe_every=moe_every, shared_expert_d_ff=shared,
        qk_norm=qk_norm, qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_theta=float(rope_theta),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", 32768),
        init_std=float(hf.get("initializer_range", 0.02)), dtype=dtype, param_dtype=dtype,
        **moe_fields,
    )


def _moe_every_for(moe_layers: tuple[int, ...], n_layers: int) -> int:
    """The `moe_every` whose MoE layers are exactly `moe_layers`, or a ValueError."""
    for n in range(n_layers + 1):
        if tuple(i for i in range(n_layers) if n and (i + 1) % n == 0) == moe_layers:
            return n
    raise ValueError(f"MoE layers {list(moe_layers)} of {n_layers} (from decoder_sparse_step and "
                     "mlp_only_layers) are not a pattern ModelConfig.moe_every can express")


def config_to_hf(config: ModelConfig, *, dtype: str = "float32",
                 model_type: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` dict for `config`: a model with MoE layers is Qwen3-MoE
    (q/k norm) or Qwen2-MoE (a shared expert, no q/k norm); a dense one (`moe_every == 0`) is
    Qwen3 (q/k norm), Qwen2 (q/k/v bias) or Llama (neither); the hybrid family Qwen3-Next, or
    Qwen3.5-MoE's text model where `model_type` asks. `model_type` (the checkpoint's own, when
    it was read from one): the export keeps it or is refused naming both. Raises for
    combinations no HF architecture has."""
    hf = _config_to_hf(config, dtype, model_type)
    if model_type and hf["model_type"] != model_type:
        raise ValueError(f"the model read as {model_type} would be written as "
                         f"{hf['model_type']}: espo_jax writes {model_type} only from its own "
                         "family's config")
    return hf


def _config_to_hf(config: ModelConfig, dtype: str, model_type: str | None) -> dict[str, Any]:
    c = config
    if hf_qwen3_next.is_hybrid(c):
        own = model_type if model_type in hf_qwen3_next.ARCHITECTURES else "qwen3_next"
        return hf_qwen3_next.config_to_hf(c, dtype, own)
    if c.router == "sigmoid_group" or c.attention == "mla":
        return hf_deepseek.config_to_hf(c, dtype)
    if c.qk_norm and (c.qkv_bias or c.shared_expert_d_ff):
        raise ValueError("no Hugging Face architecture has q/k norm together with qkv_bias or a "
                         "shared expert (Qwen3-MoE: q/k norm; Qwen2-MoE: bias + shared expert)")
    if c.n_moe_layers:
        if not c.qk_norm and not c.shared_expert_d_ff:
            raise ValueError("a config without q/k norm maps to Qwen2-MoE, which needs a shared "
                             "expert (shared_expert_d_ff > 0)")
        model_type = "qwen3_moe" if c.qk_norm else "qwen2_moe"
    else:
        model_type = "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias else "llama"
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.d_ff, "tie_word_embeddings":
        c.tie_embeddings, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rms_norm_eps": c.rms_eps, "max_position_embeddings": c.max_seq_len,
        "initializer_range": c.init_std, "hidden_act": "silu", "attention_dropout": 0.0,
        "dtype": dtype,
    }
    if c.n_moe_layers:
        hf |= {"num_experts": c.n_experts, "num_experts_per_tok": c.top_k,
               "moe_intermediate_size": c.d_expert, "decoder_sparse_step": c.moe_every,
               "mlp_only_layers": [], "norm_topk_prob": c.norm_topk_prob,
               "router_aux_loss_coef": c.aux_loss_coef}
    if model_type in ("qwen3_moe", "qwen3", "llama"):
        hf["attention_bias"] = False
    if model_type.startswith("qwen"):
        hf["use_sliding_window"] = False
    if model_type == "qwen2_moe":
        hf["qkv_bias"] = c.qkv_bias
        hf["shared_expert_intermediate_size"] = c.shared_expert_d_ff
    if model_type == "llama":
        hf["mlp_bias"] = False
    return hf
