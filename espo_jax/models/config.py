"""`ModelConfig`: the hyper-parameters of the Qwen3-MoE style decoder, and the choices its
string fields take.

A frozen (hashable) dataclass, so it can be closed over by `jax.jit` and used as a dict key.
`__post_init__` validates it, so a bad config fails before anything is traced or compiled.
The named configurations (tiny test models, the published families) are in `presets`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DISPATCHES = ("dropless", "dropless_loop", "capacity", "ragged", "dense")
# "gqa": grouped-query attention (Qwen, Llama, GLM-4.5; `gqa.Attention`); "mla": DeepSeek's
# multi-head latent attention (`mla.LatentAttention`)
ATTENTIONS = ("gqa", "mla")
# How a pass without a KV cache (the learner's forward, a prefill's is cached) computes GQA
# attention: "xla", espo_jax's own einsums (`attention.attend_keys`); "dpa",
# `jax.nn.dot_product_attention` with JAX's choice of implementation; "cudnn", the same forced
# onto cuDNN's fused kernel (GPU only: elsewhere it raises when traced)
ATTENTION_IMPLS = ("xla", "dpa", "cudnn")
# "softmax_topk": top-k of softmax(logits) (Qwen-MoE, Mixtral); "sigmoid_group": sigmoid scores,
# a correction bias and group-limited top-k (DeepSeek-V3, GLM-4.5); see espo_jax/models/router.py
ROUTERS = ("softmax_topk", "sigmoid_group")
ROPE_SCALINGS = ("default", "yarn")
# token mixers of `ModelConfig.layer_types`: softmax attention (`attention` names its kind) or
# the Gated DeltaNet linear attention of Qwen3-Next / Qwen3.5 (`gated_deltanet.GatedDeltaNet`)
LAYER_TYPES = ("full_attention", "linear_attention")
_DTYPES = ("float32", "bfloat16", "float16")
# the positions the MoE aux losses average over: "real" tokens (Hugging Face's
# `load_balancing_loss_func` with an attention mask), or "all" of a batch's rows, padding included
AUX_LOSS_TOKENS = ("real", "all")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only (MoE) transformer with Qwen3-MoE conventions."""

    vocab_size: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4  # query heads H
    n_kv_heads: int = 2  # key/value heads K (H % K == 0; K == H is MHA)
    head_dim: int = 16  # A (need not equal d_model / n_heads, as in Qwen3)
    d_ff: int = 128  # hidden size of the dense SwiGLU MLP (layers that are not MoE)
    n_experts: int = 8  # E
    top_k: int = 2  # k
    d_expert: int = 32  # F, hidden size of one expert
    moe_every: int = 1  # 1: all layers MoE; n: layers with (i+1) % n == 0; 0: dense model
    norm_topk_prob: bool = True  # renormalise the top-k gate weights to sum to one
    shared_expert_d_ff: int = 0  # 0: none; else a Qwen2-MoE shared expert with sigmoid gate
    qk_norm: bool = True  # RMSNorm on each query/key head (Qwen3)
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2)
    tie_embeddings: bool = False  # LM head = embedding transposed
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    max_seq_len: int = 2048
    aux_loss_coef: float = 0.001  # weight of the load-balancing loss in `aux_loss`
    aux_loss_tokens: str = "real"  # positions the aux losses average over (AUX_LOSS_TOKENS)
    z_loss_coef: float = 0.0  # weight of the router z-loss in `aux_loss`
    dtype: str = "float32"  # compute dtype of matmuls (norms, router, softmax stay fp32)
    param_dtype: str = "float32"
    dispatch: str = "dropless_loop"  # see DISPATCHES and espo_jax/models/moe_dispatch.py
    capacity_factor: float = 1.25  # only for dispatch == "capacity"
    # expert-parallel MoE (`moe_ep`): n > 0 exchanges each device's tokens in chunks of at most
    # n, each chunk recomputed in the backward pass, so the dropless receive buffer is ep x n x k
    # rows, not ep x (all the device's tokens) x k; 0: all of them in one exchange
    ep_chunk: int = 0
    init_std: float = 0.02  # normal init of kernels and embeddings (HF initializer_range)
    remat: bool = False  # recompute each block's activations in the backward pass (memory)
    # runs of repeating layers as one `nn.scan` each, compiled once, in the scanned parameter
    # layout (`espo_jax.models.scan`); no KV cache (the engine reads the weights per layer)
    scan_layers: bool = False
    # 0: attention materialises [B, H, T, S] scores; n > 0: queries in chunks of n tokens whose
    # scores are recomputed in the backward pass (memory O(n S) instead of O(T S); same result)
    attention_chunk: int = 0
    # n > 1: attention without a cache (the learner's forward) in n query blocks, each reading
    # only the keys up to its own end: a key after its query in a row is never visible, so
    # ~(n-1)/2n of the score work is skipped; equal to n = 1 up to float summation order.
    # Needs positions that increase along each segment of a row (every batch here has them).
    causal_blocks: int = 1
    attention_impl: str = "xla"  # ATTENTION_IMPLS
    # ---- DeepSeek-V3 / GLM-4.5 families (the defaults keep the Qwen / Llama models unchanged) ----
    attention: str = "gqa"  # ATTENTIONS
    # MLA (attention == "mla"; n_kv_heads and head_dim then unused): query low-rank size (0: a
    # full q projection), key/value latent size, per-head query/key dims without and with RoPE,
    # value head dim
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    partial_rotary_factor: float = 1.0  # GQA: RoPE on the first int(head_dim * f) dims only
    rope_interleave: bool = False  # RoPE on (even, odd) pairs, as DeepSeek's MLA (HF layout)
    rope_scaling: str = "default"  # ROPE_SCALINGS
    rope_factor: float = 1.0  # YaRN: context extension factor
    rope_original_max_len: int = 0  # YaRN: the pre-training context (original_max_position_...)
    yarn_beta_fast: float = 32.0  # YaRN: ramp bounds in rotations
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0  # YaRN attention-factor terms (0: absent, as HF's None)
    yarn_mscale_all_dim: float = 0.0
    yarn_attention_factor: float = 0.0  # 0: derived from factor and the mscales (HF's rule)
    yarn_truncate: bool = True  # round the ramp bounds to whole dims (HF `truncate`)
    first_k_dense: int = 0  # the first k layers are dense (HF first_k_dense_replace)
    n_shared_experts: int = 0  # always-on experts of width d_expert each, ungated (DeepSeek)
    router: str = "softmax_topk"  # ROUTERS
    n_group: int = 1  # sigmoid_group: experts in n_group groups, the best topk_group searched
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # sigmoid_group: gates times this factor
    # sigmoid_group: step of DeepSeek's auxiliary-loss-free bias update (0: the bias is frozen;
    # DeepSeek-V3 pre-training 0.001), applied after each learner update from its rows'
    # expert loads (`train.step.router_bias_update`, `router.update_router_biases`)
    router_bias_update_rate: float = 0.0
    # ---- Qwen3-Next / Qwen3.5-MoE hybrid family (defaults: absent) ----
    # each layer's token mixer (LAYER_TYPES); () = every layer "full_attention"
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False  # q_proj also gives a per-dim gate: out * sigmoid(gate)
    norm_zero_centered: bool = False  # RMSNorms scale by (1 + w), w initialised to 0
    # Gated DeltaNet (linear_attention layers): query/key heads and dim, value heads and dim
    # (value heads a multiple of key heads), the causal depthwise conv width, and the chunk of
    # the parallel form (a speed / memory knob: every chunk size gives the same values)
    linear_n_key_heads: int = 0
    linear_key_head_dim: int = 0
    linear_n_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    linear_chunk: int = 64

    def __post_init__(self):
        # a list (config.json, asdict round trips) becomes a tuple: the config stays hashable
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        errors = []
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads:
            errors.append(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            errors.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.moe_every < 0:
            errors.append(f"moe_every must be >= 0, got {self.moe_every}")
        if self.n_moe_layers:
            if self.n_experts < 1 or self.d_expert < 1:
                errors.append(
                    f"MoE layers need n_experts >= 1 and d_expert >= 1, got "
                    f"{self.n_experts} and {self.d_expert}"
                )
            if not 1 <= self.top_k <= self.n_experts:
                errors.append(
                    f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}"
                )
        if self.n_moe_layers < self.n_layers and self.d_ff < 1:
            errors.append(f"dense layers need d_ff >= 1, got {self.d_ff}")
        if self.shared_expert_d_ff < 0:
            errors.append(f"shared_expert_d_ff must be >= 0, got {self.shared_expert_d_ff}")
        if self.dispatch not in DISPATCHES:
            errors.append(f"dispatch {self.dispatch!r} is not one of {DISPATCHES}")
        if self.aux_loss_tokens not in AUX_LOSS_TOKENS:
            errors.append(f"aux_loss_tokens {self.aux_loss_tokens!r} is not one of "
                          f"{AUX_LOSS_TOKENS}")
        if self.causal_blocks < 1:
            errors.append(f"causal_blocks must be >= 1 (1: one block), got {self.causal_blocks}")
        if self.attention_chunk < 0:
            errors.append(f"attention_chunk must be >= 0 (0: unchunked), got "
                          f"{self.attention_chunk}")
        if self.attention_impl not in ATTENTION_IMPLS:
            errors.append(f"attention_impl {self.attention_impl!r} is not one of "
                          f"{ATTENTION_IMPLS}")
        elif self.attention_impl != "xla" and (self.attention != "gqa" or self.attention_chunk
                                               or self.causal_blocks > 1):
            errors.append(f"attention_impl {self.attention_impl!r} (jax.nn.dot_product_attention) "
                          f"takes GQA attention without attention_chunk or causal_blocks; got "
                          f"attention {self.attention!r}, attention_chunk "
                          f"{self.attention_chunk}, causal_blocks {self.causal_blocks}")
        if self.ep_chunk < 0:
            errors.append(f"ep_chunk must be >= 0 (0: one exchange), got {self.ep_chunk}")
        if self.capacity_factor <= 0:
            errors.append(f"capacity_factor must be > 0, got {self.capacity_factor}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                errors.append(f"{name} {getattr(self, name)!r} is not one of {_DTYPES}")
        if self.rms_eps <= 0 or self.rope_theta <= 0:
            errors.append("rms_eps and rope_theta must be > 0")
        errors += self._family_errors()
        if errors:
            raise ValueError("invalid ModelConfig: " + "; ".join(errors))

    def _family_errors(self) -> list[str]:
        errors = []
        for name, valid in (("attention", ATTENTIONS), ("router", ROUTERS),
                            ("rope_scaling", ROPE_SCALINGS)):
            if getattr(self, name) not in valid:
                errors.append(f"{name} {getattr(self, name)!r} is not one of {valid}")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    errors.append(f"attention 'mla' needs {name} >= 1, got {getattr(self, name)}")
            if self.qk_rope_head_dim % 2:
                errors.append(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
            if self.q_lora_rank < 0:
                errors.append(f"q_lora_rank must be >= 0 (0: none), got {self.q_lora_rank}")
            if self.qk_norm or self.qkv_bias or self.partial_rotary_factor != 1:
                errors.append("qk_norm, qkv_bias and partial_rotary_factor are GQA options; "
                              "attention 'mla' takes none of them")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            errors.append(f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] "
                          f"and give an even rotary dim (head_dim {self.head_dim})")
        if self.rope_scaling == "yarn" and (self.rope_factor <= 0
                                            or self.rope_original_max_len < 1):
            errors.append(f"YaRN needs rope_factor > 0 and rope_original_max_len >= 1, got "
                          f"{self.rope_factor} and {self.rope_original_max_len}")
        if self.first_k_dense < 0 or self.n_shared_experts < 0:
            errors.append("first_k_dense and n_shared_experts must be >= 0")
        if self.router == "sigmoid_group" and self.n_moe_layers:
            if self.n_group < 1 or self.n_experts % self.n_group:
                errors.append(f"n_experts ({self.n_experts}) must be divisible by n_group "
                              f"({self.n_group} >= 1)")
            elif not 1 <= self.topk_group <= self.n_group:
                errors.append(f"topk_group must be in [1, n_group={self.n_group}], got "
                              f"{self.topk_group}")
            elif self.top_k > self.topk_group * (self.n_experts // self.n_group):
                errors.append(f"top_k ({self.top_k}) exceeds the experts of topk_group "
                              f"({self.topk_group}) groups of {self.n_experts // self.n_group}")
            elif self.n_group > 1 and self.n_experts // self.n_group < 2:
                errors.append("group-limited routing scores each group by its two best experts: "
                              f"needs >= 2 experts per group, got {self.n_experts // self.n_group}")
        errors += self._hybrid_errors()
        if self.router_bias_update_rate < 0:
            errors.append(f"router_bias_update_rate must be >= 0, got "
                          f"{self.router_bias_update_rate}")
        return errors

    def _hybrid_errors(self) -> list[str]:
        errors = []
        if self.layer_types and len(self.layer_types) != self.n_layers:
            errors.append(f"layer_types has {len(self.layer_types)} entries for n_layers "
                          f"{self.n_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            errors.append(f"layer_types {bad} are not in {LAYER_TYPES}")
        if self.linear_layers:
            for name in ("linear_n_key_heads", "linear_key_head_dim", "linear_n_value_heads",
                         "linear_value_head_dim", "linear_conv_kernel", "linear_chunk"):
                if getattr(self, name) < 1:
                    errors.append(f"linear_attention layers need {name} >= 1, got "
                                  f"{getattr(self, name)}")
            if self.linear_n_key_heads >= 1 and self.linear_n_value_heads % self.linear_n_key_heads:
                errors.append(f"linear_n_value_heads ({self.linear_n_value_heads}) must be a "
                              f"multiple of linear_n_key_heads ({self.linear_n_key_heads})")
        if self.attn_output_gate and self.attention != "gqa":
            errors.append("attn_output_gate is a GQA option (attention 'gqa')")
        return errors

    # ---- derived quantities -------------------------------------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (0-based) is an MoE layer (HF Qwen3-MoE `decoder_sparse_step`)."""
        return self.moe_every > 0 and (i + 1) % self.moe_every == 0 and i >= self.first_k_dense

    @property
    def rotary_dim(self) -> int:
        """Dims of each GQA head that RoPE rotates (all unless `partial_rotary_factor` < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, i: int) -> str:
        """Layer i's token mixer, one of LAYER_TYPES."""
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet (linear_attention) layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers; position m in this tuple is the M axis of routing arrays."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def forward_only(self) -> ModelConfig:
        """This model for passes without a gradient (the learner's old-policy and reference
        passes): a gathered dropless dispatch ("dropless") becomes the looped one, which reads
        each expert's weights once instead of copying them into [blocks, D, F]. The same
        outputs bit for bit (tests/models/test_model.py; times in
        `espo_jax/models/moe_dispatch.py`)."""
        return self.replace(dispatch="dropless_loop") if self.dispatch == "dropless" else self

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        """The config whose `dataclasses.asdict` is `raw` (e.g. published weights'
        config.json); a field this ModelConfig does not know is a ValueError naming `source`."""
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"{source} does not match this ModelConfig: {e}") from None
