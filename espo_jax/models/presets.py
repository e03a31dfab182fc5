"""Named `ModelConfig`s: the tiny models the tests and the experiments' small variants run, the
default CPU experiment's, and the published families' real sizes (Qwen3-MoE, DeepSeek-V3,
GLM-4.5-Air, Qwen3-Next, Qwen3.5-MoE) with a tiny twin of each that exercises every option.

A table of numbers apart from the dataclass that checks them: `get_preset(name, **overrides)`
builds one, and `PRESETS` lists the names (`model.preset` in an experiment's config).
"""

from __future__ import annotations

from typing import Any

from espo_jax.models.config import ModelConfig

# Real Qwen3-MoE numbers from the Hugging Face config.json files of Qwen/Qwen3-30B-A3B and
# Qwen/Qwen3-235B-A22B (dense d_ff is their `intermediate_size`, unused as every layer is MoE).
_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: compiles in seconds. vocab 128 holds the 99-symbol CharTokenizer.
    "tiny": dict(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
        n_experts=8, top_k=2, d_expert=32, max_seq_len=512,
    ),
    # The default CPU experiment: 4.96M parameters, 0.83M active per token; a jitted fp32
    # train step on 16 x 128 tokens takes ~0.6 CPU-seconds here (dropless dispatch).
    "small": dict(
        vocab_size=128, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512,
        n_experts=16, top_k=2, d_expert=192, max_seq_len=1024,
    ),
    "qwen3_30b_a3b": dict(
        vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        d_ff=6144, n_experts=128, top_k=8, d_expert=768, norm_topk_prob=True, rope_theta=1e6,
        rms_eps=1e-6, max_seq_len=40960, tie_embeddings=False, dtype="bfloat16",
        param_dtype="bfloat16", dispatch="ragged",
    ),
    "qwen3_235b_a22b": dict(
        vocab_size=151936, d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
        d_ff=12288, n_experts=128, top_k=8, d_expert=1536, norm_topk_prob=True, rope_theta=1e6,
        rms_eps=1e-6, max_seq_len=40960, tie_embeddings=False, dtype="bfloat16",
        param_dtype="bfloat16", dispatch="ragged",
    ),
    # DeepSeek-V3 (671B, 37B active): transformers' DeepseekV3Config defaults, which are V3's
    # config.json, and its rope_scaling (YaRN factor 40 over 4096 tokens, mscale 1 = mscale_all_dim,
    # max_position_embeddings 163840); what `hf_deepseek.config_from_hf` makes of that config.json.
    "deepseek_v3": dict(
        vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=64,
        d_ff=18432, n_experts=256, top_k=8, d_expert=2048, first_k_dense=3, n_shared_experts=1,
        router="sigmoid_group", n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
        qk_norm=False, rope_theta=10000.0, rope_scaling="yarn", rope_factor=40.0,
        rope_original_max_len=4096, yarn_mscale=1.0, yarn_mscale_all_dim=1.0, rms_eps=1e-6,
        max_seq_len=163840, aux_loss_coef=0.0, dtype="bfloat16", param_dtype="bfloat16",
        dispatch="ragged",
    ),
    # GLM-4.5-Air (106B, 12B active): transformers' Glm4MoeConfig defaults (46 layers, d 4096,
    # 96 / 8 heads of 128, half rotated, 128 experts of 1408 top 8, one shared, one dense first
    # layer of 10944, no groups, scale 1, no q/k norm, eps 1e-5, |V| 151552) with head_dim 128,
    # the q/k/v bias (`attention_bias`) and rope_theta 1e6 of zai-org/GLM-4.5-Air's config.json.
    "glm45_air": dict(
        vocab_size=151552, d_model=4096, n_layers=46, n_heads=96, n_kv_heads=8, head_dim=128,
        d_ff=10944, n_experts=128, top_k=8, d_expert=1408, first_k_dense=1, n_shared_experts=1,
        router="sigmoid_group", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, partial_rotary_factor=0.5, qk_norm=False, qkv_bias=True,
        rope_theta=1e6, rms_eps=1e-5, max_seq_len=131072, aux_loss_coef=0.0, dtype="bfloat16",
        param_dtype="bfloat16", dispatch="ragged",
    ),
    # The same families at "tiny" size (tests, the experiments' small variants): every option of
    # the real configs, groups and YaRN included (original context 16 < the 56-token rollouts).
    "tiny_deepseek_v3": dict(
        vocab_size=128, d_model=64, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=8, d_ff=128,
        n_experts=8, top_k=2, d_expert=32, first_k_dense=1, n_shared_experts=1,
        router="sigmoid_group", n_group=4, topk_group=2, routed_scaling_factor=2.5,
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, qk_norm=False,
        rope_theta=10000.0, rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16,
        yarn_mscale=1.0, yarn_mscale_all_dim=1.0, max_seq_len=512, aux_loss_coef=0.0,
    ),
    "tiny_glm45": dict(
        vocab_size=128, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
        n_experts=8, top_k=2, d_expert=32, first_k_dense=1, n_shared_experts=1,
        router="sigmoid_group", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        partial_rotary_factor=0.5, qk_norm=False, qkv_bias=True, rms_eps=1e-5, max_seq_len=512,
        aux_loss_coef=0.0,
    ),
    # Qwen3-Next-80B-A3B (80B, 3B active): transformers' Qwen3NextConfig defaults (d 2048, 48
    # layers, 16 / 2 heads of 256 with a quarter rotated and an output gate; Gated DeltaNet 16
    # key heads x 128, 32 value heads x 128, conv 4; 512 experts of 512, top 10, a gated shared
    # expert of 512; every 4th layer full attention, the rest linear) with the published
    # config.json's intermediate_size 5120, max_position_embeddings 262144 and rope_theta 1e7.
    "qwen3_next_80b_a3b": dict(
        vocab_size=151936, d_model=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256,
        d_ff=5120, n_experts=512, top_k=10, d_expert=512, shared_expert_d_ff=512,
        norm_topk_prob=True, partial_rotary_factor=0.25, attn_output_gate=True,
        norm_zero_centered=True, layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)),
        linear_n_key_heads=16, linear_key_head_dim=128, linear_n_value_heads=32,
        linear_value_head_dim=128, linear_conv_kernel=4, rope_theta=1e7, rms_eps=1e-6,
        max_seq_len=262144, dtype="bfloat16", param_dtype="bfloat16", dispatch="ragged",
    ),
    # Qwen3.5-35B-A3B (text model): transformers' Qwen3_5MoeTextConfig defaults (|V| 248320,
    # d 2048, 40 layers, 16 / 2 heads of 256, a quarter rotated, output gate; the same Gated
    # DeltaNet; 256 experts of 512, top 8, gated shared expert of 512; full attention every 4th
    # layer) with rope_theta 1e7 and a 262144-token context as published.
    "qwen35_35b_a3b": dict(
        vocab_size=248320, d_model=2048, n_layers=40, n_heads=16, n_kv_heads=2, head_dim=256,
        d_ff=512, n_experts=256, top_k=8, d_expert=512, shared_expert_d_ff=512,
        norm_topk_prob=True, partial_rotary_factor=0.25, attn_output_gate=True,
        norm_zero_centered=True, layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)),
        linear_n_key_heads=16, linear_key_head_dim=128, linear_n_value_heads=32,
        linear_value_head_dim=128, linear_conv_kernel=4, rope_theta=1e7, rms_eps=1e-6,
        max_seq_len=262144, dtype="bfloat16", param_dtype="bfloat16", dispatch="ragged",
    ),
    # The hybrid family at "tiny" size: linear and full layers, value heads grouped over key
    # heads, a small chunk (8) so test sequences span several, partial rotary, the output gate,
    # zero-centred norms, a gated shared expert; qwen3_next also a dense layer (moe_every 2).
    "tiny_qwen3_next": dict(
        vocab_size=128, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96,
        n_experts=8, top_k=2, d_expert=32, moe_every=2, shared_expert_d_ff=48,
        partial_rotary_factor=0.25, attn_output_gate=True, norm_zero_centered=True,
        layer_types=("linear_attention", "full_attention", "linear_attention",
                     "full_attention"),
        linear_n_key_heads=2, linear_key_head_dim=8, linear_n_value_heads=4,
        linear_value_head_dim=8, linear_conv_kernel=4, linear_chunk=8, max_seq_len=512,
    ),
    "tiny_qwen35_moe": dict(
        vocab_size=128, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=32,
        n_experts=8, top_k=2, d_expert=32, shared_expert_d_ff=48,
        partial_rotary_factor=0.25, attn_output_gate=True, norm_zero_centered=True,
        layer_types=("linear_attention", "linear_attention", "linear_attention",
                     "full_attention"),
        linear_n_key_heads=2, linear_key_head_dim=8, linear_n_value_heads=4,
        linear_value_head_dim=8, linear_conv_kernel=4, linear_chunk=8, max_seq_len=512,
    ),
}
PRESETS = tuple(_PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset (one of PRESETS), with `overrides` applied."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {PRESETS}")
    return ModelConfig(**{**_PRESETS[name], **overrides})
