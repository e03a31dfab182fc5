"""espo_jax.models: a Qwen3-MoE style decoder-only transformer in Flax Linen, with the
DeepSeek-V3 / GLM-4.5 variants chosen by `ModelConfig` fields (MLA attention, the sigmoid
group-limited router, shared experts, dense first layers).

Dimension letters used in array names throughout espo_jax (`logits_BxTxV`):
  B batch, T sequence (new tokens), S cache length, D model width, H query heads,
  K key/value heads, A head dim, F expert hidden, E experts, V vocabulary, L layers,
  M MoE layers, k experts per token (top-k; `top_k` in code), N = B*T flattened tokens.

Parameters are a plain nested dict (no "params" wrapper):
  {"embed": {"embedding": [V, D]},
   "layers_{i}": {"attn_norm": {"scale": [D]},
                  "attn": {"q_proj": {"kernel": [D, H*A], "bias"?}, "k_proj": {"kernel": [D, K*A]},
                           "v_proj": {"kernel": [D, K*A]}, "o_proj": {"kernel": [H*A, D]},
                           "q_norm": {"scale": [A]}, "k_norm": {"scale": [A]}},
                  "mlp_norm": {"scale": [D]},
                  "moe": {"router": {"kernel": [D, E], "e_score_correction_bias"?: [E] fp32},
                          "wi_gate": [E, D, F], "wi_up": [E, D, F], "wo": [E, F, D],
                          "shared_expert"?: {...}, "shared_expert_gate"?: ...,
                          "shared_experts"?: {"gate_proj", "up_proj", "down_proj"}}
                  | "mlp": {"gate_proj", "up_proj", "down_proj"}},
   "final_norm": {"scale": [D]}, "lm_head": {"kernel": [D, V]} (absent when tied)}
With attention == "mla" a layer's "attn" is instead (C kv_lora_rank, R qk_rope_head_dim, P
qk_nope_head_dim, Dv v_head_dim, Q = P + R):
  {"q_proj": [D, H*Q]} | {"q_a_proj": [D, q_lora_rank], "q_a_norm": {"scale"},
   "q_b_proj": [q_lora_rank, H*Q]}, "kv_a_proj": [D, C+R], "kv_a_norm": {"scale": [C]},
  "kv_b_proj": [C, H*(P+Dv)], "o_proj": [H*Dv, D] (each {"kernel": ...}).
A "linear_attention" layer (`layer_types`; Qwen3-Next, Qwen3.5) has "linear_attn" instead of
"attn" (Hk/Dk key heads, Hv/Dv value heads, W conv width; `gated_deltanet`):
  {"q_proj", "k_proj": [D, Hk*Dk], "v_proj", "z_proj": [D, Hv*Dv], "b_proj", "a_proj": [D, Hv]
   (each {"kernel"}), "conv_q", "conv_k": [W, Hk*Dk], "conv_v": [W, Hv*Dv], "A_log", "dt_bias":
   [Hv], "norm": {"scale": [Dv]}, "o_proj": {"kernel": [Hv*Dv, D]}};
with attn_output_gate a GQA q_proj is [D, H*2A], per head [query A, gate A].
"e_score_correction_bias" (router == "sigmoid_group") orders experts and never receives a
gradient; "shared_experts" (n_shared_experts > 0) is one SwiGLU of width n_shared_experts * F.
Kernels are [in, out]. A kernel may also be an FP8 pytree {"qvalue", "scale"} (see `quant`).
With `scan_layers` a run of repeating layers is one entry "scan_{start}_{stop}" instead:
{"layer_{q}": a layer's tree above, every array with a leading axis of the run's repeats}
(`scan`; `scan.unstack` gives the per-layer tree back).
"""

from espo_jax.models import moe, quant
from espo_jax.models.config import ModelConfig
from espo_jax.models.presets import PRESETS, get_preset
from espo_jax.models.router import routing_flip_rate
from espo_jax.models.transformer import (
    ModelOutput,
    cache_slot_axes,
    forward,
    init_boxed,
    init_cache,
    init_params,
    lm_head_kernel,
)

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ModelOutput",
    "cache_slot_axes",
    "forward",
    "get_preset",
    "init_boxed",
    "init_cache",
    "init_params",
    "lm_head_kernel",
    "moe",
    "quant",
    "routing_flip_rate",
]
