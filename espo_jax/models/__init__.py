"""espo_jax.models: a Qwen3-MoE style decoder-only transformer in Flax Linen.

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
                  "moe": {"router": {"kernel": [D, E]}, "wi_gate": [E, D, F], "wi_up": [E, D, F],
                          "wo": [E, F, D], "shared_expert"?: {...}, "shared_expert_gate"?: ...}
                  | "mlp": {"gate_proj", "up_proj", "down_proj"}},
   "final_norm": {"scale": [D]}, "lm_head": {"kernel": [D, V]} (absent when tied)}
Kernels are [in, out]. A kernel may also be an FP8 pytree {"qvalue", "scale"} (see `quant`).
"""

from espo_jax.models import moe, quant
from espo_jax.models.config import PRESETS, ModelConfig, get_preset
from espo_jax.models.router import routing_flip_rate
from espo_jax.models.transformer import (
    ModelOutput,
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
