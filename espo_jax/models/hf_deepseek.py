"""config.json <-> `ModelConfig` for the DeepSeek-V3 and GLM-4.5 families (transformers
`deepseek_v3` and `glm4_moe`; `hf_io` reads and writes their tensors).

Both have the sigmoid group-limited router with a correction bias, ungated shared experts and
dense first layers; DeepSeek-V3 (and V3.1, Kimi-K2, Moonlight) has multi-head latent attention
with interleaved, usually YaRN-scaled RoPE, GLM-4.5 / 4.6 grouped-query attention with partial
rotary, q/k/v bias and optional q/k norm. Their multi-token-prediction layers
(`num_nextn_predict_layers`, stored as layers past `num_hidden_layers`) serve speculative
decoding, not the policy: `hf_io.from_pretrained` skips them. A field this model cannot honour
is refused by name.
"""

from __future__ import annotations

from typing import Any

from espo_jax.models.config import ModelConfig

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "moe_intermediate_size", "num_experts_per_tok",
             "n_routed_experts")
_REQUIRED_MLA = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "truncate", "partial_rotary_factor"}


def _refuse(model_type: str, hf: dict[str, Any]) -> None:
    """ValueError naming each field of `hf` with a value this model does not implement."""
    bad = []
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        bad.append(f"scoring_func={hf['scoring_func']!r} (only 'sigmoid')")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        bad.append(f"topk_method={hf['topk_method']!r} (only 'noaux_tc')")
    if hf.get("moe_layer_freq", 1) != 1:
        bad.append(f"moe_layer_freq={hf['moe_layer_freq']} (only 1)")
    if model_type == "deepseek_v3":
        if hf.get("attention_bias", False):
            bad.append("attention_bias=True (MLA without biases only)")
        heads = hf.get("num_attention_heads")
        if hf.get("num_key_value_heads") not in (None, heads):
            bad.append(f"num_key_value_heads={hf['num_key_value_heads']} (MLA: as "
                       f"num_attention_heads={heads})")
    if bad:
        raise ValueError(f"{model_type} config.json: unsupported " + "; ".join(bad))


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"unsupported RoPE scaling {kind!r} in {rope}; supported: default, yarn")
    unknown = sorted(set(rope) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"unsupported rope_parameters fields {unknown}")
    out: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta",
                                                        hf.get("rope_theta", 10000.0)))}
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings",
                            hf.get("max_position_embeddings"))
        factor = rope.get("factor") or hf["max_position_embeddings"] / original
        out |= dict(rope_scaling="yarn", rope_factor=float(factor),
                    rope_original_max_len=int(original),
                    yarn_beta_fast=float(rope.get("beta_fast") or 32),
                    yarn_beta_slow=float(rope.get("beta_slow") or 1),
                    yarn_mscale=float(rope.get("mscale") or 0),
                    yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                    yarn_attention_factor=float(rope.get("attention_factor") or 0),
                    yarn_truncate=bool(rope.get("truncate", True)))
    prf = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if prf is not None:
        out["partial_rotary_factor"] = float(prf)
    return out


def config_from_hf(hf: dict[str, Any], dtype: str) -> ModelConfig:
    """The `ModelConfig` of a `deepseek_v3` or `glm4_moe` config.json (parsed)."""
    model_type = hf["model_type"]
    mla = model_type == "deepseek_v3"
    missing = [k for k in _REQUIRED + (_REQUIRED_MLA if mla else ()) if hf.get(k) is None]
    if missing:
        raise ValueError(f"config.json ({model_type}) lacks required fields: {missing}")
    _refuse(model_type, hf)
    n_heads = hf["num_attention_heads"]
    fields: dict[str, Any] = _rope_fields(hf)
    if mla:
        fields |= dict(attention="mla", n_kv_heads=n_heads, head_dim=hf["qk_rope_head_dim"],
                       q_lora_rank=hf.get("q_lora_rank") or 0,
                       kv_lora_rank=hf["kv_lora_rank"],
                       qk_nope_head_dim=hf["qk_nope_head_dim"],
                       qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                       rope_interleave=bool(hf.get("rope_interleave", True)), qk_norm=False)
        fields.pop("partial_rotary_factor", None)  # MLA rotates its rope dims whole
    else:
        fields.setdefault("partial_rotary_factor", 0.5)  # transformers' glm4_moe default
        fields |= dict(n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                       head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
                       qk_norm=bool(hf.get("use_qk_norm", False)),
                       qkv_bias=bool(hf.get("attention_bias", False)))
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=n_heads, d_ff=hf["intermediate_size"],
        n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
        d_expert=hf["moe_intermediate_size"], moe_every=1,
        first_k_dense=int(hf.get("first_k_dense_replace") or 0),
        n_shared_experts=int(hf.get("n_shared_experts") or 0), router="sigmoid_group",
        n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), aux_loss_coef=0.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        init_std=float(hf.get("initializer_range", 0.02)), dtype=dtype, param_dtype=dtype,
        **fields,
    )


def config_to_hf(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """The config.json of `config` as `deepseek_v3` (MLA) or `glm4_moe` (GQA); a config neither
    can express is a ValueError naming the field."""
    c = config
    model_type = "deepseek_v3" if c.attention == "mla" else "glm4_moe"
    bad = []
    if c.router != "sigmoid_group":
        bad.append(f"router={c.router!r} (both families: 'sigmoid_group')")
    if c.moe_every != 1 or not c.n_moe_layers:
        bad.append(f"moe_every={c.moe_every} (MoE after the first_k_dense layers: 1)")
    if c.shared_expert_d_ff:
        bad.append("shared_expert_d_ff (a gated Qwen2-MoE shared expert)")
    if c.attention != "mla" and c.rope_interleave:
        bad.append("rope_interleave with GQA")
    if bad:
        raise ValueError(f"config cannot be written as {model_type}: " + "; ".join(bad))
    rope: dict[str, Any] = {"rope_type": c.rope_scaling, "rope_theta": c.rope_theta}
    if c.rope_scaling == "yarn":
        rope |= {"factor": c.rope_factor, "original_max_position_embeddings":
                 c.rope_original_max_len, "beta_fast": c.yarn_beta_fast,
                 "beta_slow": c.yarn_beta_slow, "truncate": c.yarn_truncate}
        for key, value in (("mscale", c.yarn_mscale), ("mscale_all_dim", c.yarn_mscale_all_dim),
                           ("attention_factor", c.yarn_attention_factor)):
            if value:
                rope[key] = value
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "intermediate_size": c.d_ff,
        "moe_intermediate_size": c.d_expert, "n_routed_experts": c.n_experts,
        "num_experts_per_tok": c.top_k, "n_shared_experts": c.n_shared_experts,
        "first_k_dense_replace": c.first_k_dense, "n_group": c.n_group,
        "topk_group": c.topk_group, "routed_scaling_factor": c.routed_scaling_factor,
        "norm_topk_prob": c.norm_topk_prob, "tie_word_embeddings": c.tie_embeddings,
        "rms_norm_eps": c.rms_eps, "max_position_embeddings": c.max_seq_len,
        "initializer_range": c.init_std, "hidden_act": "silu", "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0, "rope_parameters": rope, "dtype": dtype,
    }
    if model_type == "deepseek_v3":
        hf |= {"num_key_value_heads": c.n_heads, "q_lora_rank": c.q_lora_rank or None,
               "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim,
               "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
               "rope_interleave": c.rope_interleave, "attention_bias": False}
    else:
        rope["partial_rotary_factor"] = c.partial_rotary_factor
        hf |= {"num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
               "use_qk_norm": c.qk_norm, "attention_bias": c.qkv_bias}
    return hf


def mla_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The [in, out] kernel (and norm scale) shapes of an MLA layer's parameters by name."""
    c = config
    d, h, qk = c.d_model, c.n_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    return {"q_proj": (d, h * qk), "q_a_proj": (d, c.q_lora_rank), "q_a_norm": (c.q_lora_rank,),
            "q_b_proj": (c.q_lora_rank, h * qk),
            "kv_a_proj": (d, c.kv_lora_rank + c.qk_rope_head_dim),
            "kv_a_norm": (c.kv_lora_rank,),
            "kv_b_proj": (c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim)),
            "o_proj": (h * c.v_head_dim, d)}
