"""config.json and tensor names <-> `ModelConfig` and params for the hybrid linear-attention
MoE family: Qwen3-Next (transformers `qwen3_next`) and the Qwen3.5-MoE text model
(`qwen3_5_moe_text`; a `qwen3_5_moe` config with its `text_config` reads too, its tensors under
`model.language_model.`, the vision tower skipped). `hf_io` moves the tensors.

Both: Gated DeltaNet layers (`linear_attention`) beside gated full attention (q_proj gives the
query and a sigmoid output gate per head dim; a quarter of each head rotated; zero-centred
RMSNorms, (1 + w)), top-k softmax routing with a sigmoid-gated shared expert. They differ in how
the Gated DeltaNet input projections are stored:
- qwen3_next: `in_proj_qkvz` [2 Hk Dk + 2 Hv Dv, D], grouped per key head j: [q_j (Dk), k_j
  (Dk), v of its Hv/Hk value heads, z of them], and `in_proj_ba` [2 Hv, D], per key head [b of
  its value heads, a of them];
- qwen3_5_moe: `in_proj_qkv` (all q heads, all k heads, all v heads), `in_proj_z`,
  `in_proj_b`, `in_proj_a`.
The conv weight [2 Hk Dk + Hv Dv, 1, W] is ordered q, k, v in both; ours are three kernels [W, C].
Multi-token-prediction tensors (`mtp.*`) serve speculative decoding and are skipped on read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from espo_jax.models.config import LAYER_TYPES, ModelConfig

ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
TOP_LEVEL = "qwen3_5_moe"  # Qwen3_5MoeForConditionalGeneration: the text model under text_config
SKIPPED_PREFIXES = ("mtp.", "model.visual.")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
             "linear_key_head_dim", "linear_value_head_dim")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a `qwen3_5_moe` (multimodal) config.json, else `hf`."""
    if hf.get("model_type") != TOP_LEVEL:
        return hf
    text = dict(hf.get("text_config") or {})
    text.setdefault("model_type", "qwen3_5_moe_text")
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text


def tensor_prefix(hf: dict[str, Any]) -> str:
    """Where the text model's tensors live: `model.language_model.` for `qwen3_5_moe`."""
    return "model.language_model." if hf.get("model_type") == TOP_LEVEL else "model."


def config_from_hf(hf: dict[str, Any], dtype: str) -> ModelConfig:
    """The `ModelConfig` of a `qwen3_next` / `qwen3_5_moe_text` config.json (parsed)."""
    model_type = hf["model_type"]
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise ValueError(f"config.json ({model_type}) lacks required fields: {missing}")
    bad = []
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("attention_bias", False):
        bad.append("attention_bias=True (bias on o_proj too)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{model_type}: unsupported RoPE scaling {rope}; only the default RoPE")
    if rope.get("mrope_section") and not rope.get("mrope_interleaved", True):
        bad.append("mrope_interleaved=False")
    if bad:
        raise ValueError(f"{model_type} config.json: unsupported " + "; ".join(bad))
    n_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else
        "full_attention" for i in range(n_layers)]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{model_type}: layer_types {unknown} are not in {LAYER_TYPES}")
    if model_type == "qwen3_next":
        step, mlp_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        moe = tuple(i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0)
        if moe != tuple(i for i in range(n_layers) if (i + 1) % step == 0):
            raise ValueError(f"{model_type}: mlp_only_layers {sorted(mlp_only)} with "
                             f"decoder_sparse_step {step} is not a pattern ModelConfig.moe_every "
                             "can express")
        moe_every, d_ff = step, hf.get("intermediate_size", 5632)
        norm_topk = bool(hf.get("norm_topk_prob", True))
    else:  # Qwen3.5-MoE: every layer MoE, top-k weights always renormalised
        moe_every, d_ff, norm_topk = 1, hf["moe_intermediate_size"], True
    prf = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n_layers,
        n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        d_ff=d_ff, n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
        d_expert=hf["moe_intermediate_size"], moe_every=moe_every, norm_topk_prob=norm_topk,
        shared_expert_d_ff=hf.get("shared_expert_intermediate_size", 512),
        partial_rotary_factor=float(prf), attn_output_gate=True, norm_zero_centered=True,
        layer_types=tuple(layer_types), linear_n_key_heads=hf["linear_num_key_heads"],
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_n_value_heads=hf["linear_num_value_heads"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", 32768),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        init_std=float(hf.get("initializer_range", 0.02)), dtype=dtype, param_dtype=dtype,
    )


def is_hybrid(config: ModelConfig) -> bool:
    """Whether `config` belongs to this family (the way `config_to_hf` picks it)."""
    return bool(config.linear_layers) or config.attn_output_gate or config.norm_zero_centered


def config_to_hf(config: ModelConfig, dtype: str, model_type: str = "qwen3_next"
                 ) -> dict[str, Any]:
    """The config.json of `config` as `model_type` writes it: `qwen3_next` (the general one) or
    `qwen3_5_moe_text` (Qwen3.5-MoE's text model: every layer MoE, top-k weights renormalised;
    what a Qwen3.5-MoE checkpoint read exports as, `hf_io.source_model_type`). A config the
    family cannot express is a ValueError naming the field."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}")
    c = config
    bad = []
    if model_type != "qwen3_next" and (c.moe_every != 1 or not c.norm_topk_prob):
        bad.append(f"{model_type} needs every layer MoE (moe_every={c.moe_every}) with "
                   f"norm_topk_prob (={c.norm_topk_prob})")
    for name in ("attn_output_gate", "norm_zero_centered", "qk_norm"):
        if not getattr(c, name):
            bad.append(f"{name}=False")
    if c.qkv_bias or c.attention != "gqa" or c.router != "softmax_topk":
        bad.append("qkv_bias / MLA / sigmoid routing")
    if not c.shared_expert_d_ff or c.n_shared_experts or c.first_k_dense:
        bad.append("needs one gated shared expert (shared_expert_d_ff), no ungated or dense-first")
    if c.rope_scaling != "default":
        bad.append(f"rope_scaling={c.rope_scaling!r}")
    if bad:
        raise ValueError(f"config cannot be written as {model_type}: " + "; ".join(bad))
    only_next = {"intermediate_size": c.d_ff, "decoder_sparse_step": c.moe_every,
                 "mlp_only_layers": [], "norm_topk_prob": c.norm_topk_prob}
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "num_experts": c.n_experts,
        "num_experts_per_tok": c.top_k, "moe_intermediate_size": c.d_expert,
        "shared_expert_intermediate_size": c.shared_expert_d_ff,
        **(only_next if model_type == "qwen3_next" else {}),
        "router_aux_loss_coef": c.aux_loss_coef,
        "layer_types": [c.layer_type(i) for i in range(c.n_layers)],
        "linear_num_key_heads": c.linear_n_key_heads, "linear_key_head_dim":
        c.linear_key_head_dim, "linear_num_value_heads": c.linear_n_value_heads,
        "linear_value_head_dim": c.linear_value_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.partial_rotary_factor},
        "partial_rotary_factor": c.partial_rotary_factor,
        "tie_word_embeddings": c.tie_embeddings, "rms_norm_eps": c.rms_eps,
        "max_position_embeddings": c.max_seq_len, "initializer_range": c.init_std,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "dtype": dtype,
    }


# ---- the Gated DeltaNet tensors -------------------------------------------------------------
def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of a `gated_deltanet.GatedDeltaNet` layer's leaves, by '/'-joined name."""
    c = config
    d, w = c.d_model, c.linear_conv_kernel
    qk, v, hv = c.linear_n_key_heads * c.linear_key_head_dim, (
        c.linear_n_value_heads * c.linear_value_head_dim), c.linear_n_value_heads
    return {"q_proj/kernel": (d, qk), "k_proj/kernel": (d, qk), "v_proj/kernel": (d, v),
            "z_proj/kernel": (d, v), "b_proj/kernel": (d, hv), "a_proj/kernel": (d, hv),
            "conv_q": (w, qk), "conv_k": (w, qk), "conv_v": (w, v), "A_log": (hv,),
            "dt_bias": (hv,), "norm/scale": (c.linear_value_head_dim,), "o_proj/kernel": (v, d)}


def _grouped_split(config: ModelConfig) -> tuple[list[str], list[int]]:
    """qwen3_next's per-key-head grouping of in_proj_qkvz rows (names and sizes in a group)."""
    c = config
    r = c.linear_n_value_heads // c.linear_n_key_heads
    return (["q", "k", "v", "z"], [c.linear_key_head_dim, c.linear_key_head_dim,
                                    r * c.linear_value_head_dim, r * c.linear_value_head_dim])


def linear_entry(config: ModelConfig, path: tuple[str, ...], hf: str, model_type: str) -> tuple:
    """One `hf_param_map.param_map` entry for a whole Gated DeltaNet layer: (path of its subtree, HF
    names, subtree -> HF arrays, getter -> subtree)."""
    c = config
    hk, hv = c.linear_n_key_heads, c.linear_n_value_heads
    qk = hk * c.linear_key_head_dim
    common = ["conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"]
    fused = ["in_proj_qkvz.weight", "in_proj_ba.weight"] if model_type == "qwen3_next" else [
        "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"]
    names = [f"{hf}.{n}" for n in fused + common]
    parts, sizes = _grouped_split(c)

    def to_hf(tree: dict) -> list[np.ndarray]:
        k = {n: np.asarray(tree[f"{n}_proj"]["kernel"]).T for n in "qkvzba"}  # [out, D]
        if model_type == "qwen3_next":
            d = k["q"].shape[1]
            qkvz = np.concatenate([k[n].reshape(hk, s, d) for n, s in zip(parts, sizes,
                                                                          strict=True)], 1)
            ba = np.concatenate([k[n].reshape(hk, hv // hk, d) for n in "ba"], 1)
            proj = [qkvz.reshape(-1, d), ba.reshape(-1, d)]
        else:
            proj = [np.concatenate([k["q"], k["k"], k["v"]]), k["z"], k["b"], k["a"]]
        conv = np.concatenate([np.asarray(tree[f"conv_{n}"]) for n in "qkv"], 1).T[:, None]
        return proj + [conv, np.asarray(tree["dt_bias"]), np.asarray(tree["A_log"]),
                       np.asarray(tree["norm"]["scale"]), np.asarray(tree["o_proj"]["kernel"]).T]

    def from_hf(get) -> dict:
        if model_type == "qwen3_next":
            qkvz = get(names[0])
            d = qkvz.shape[1]
            grouped = np.split(qkvz.reshape(hk, sum(sizes), d), np.cumsum(sizes)[:-1], axis=1)
            k = {n: x.reshape(-1, d) for n, x in zip(parts, grouped, strict=True)}
            b, a = np.split(get(names[1]).reshape(hk, 2 * (hv // hk), d), 2, axis=1)
            k |= {"b": b.reshape(-1, d), "a": a.reshape(-1, d)}
            rest = names[2:]
        else:
            q, kk, v = np.split(get(names[0]), [qk, 2 * qk])
            k = {"q": q, "k": kk, "v": v, "z": get(names[1]), "b": get(names[2]),
                 "a": get(names[3])}
            rest = names[4:]
        conv, dt_bias, a_log, norm, out = (get(n) for n in rest)
        conv_q, conv_k, conv_v = np.split(conv[:, 0].T, [qk, 2 * qk], axis=1)
        tree = {f"{n}_proj": {"kernel": k[n].T} for n in "qkvzba"}
        return tree | {"conv_q": conv_q, "conv_k": conv_k, "conv_v": conv_v, "A_log": a_log,
                       "dt_bias": dt_bias, "norm": {"scale": norm}, "o_proj": {"kernel": out.T}}

    return (path, names, to_hf, from_hf)
