"""The parameter and FLOP model of a `ModelConfig`: one count for every family, read by every
MFU and tokens/s figure (the benchmarks, the device check, the profile) and every parameter
count (`param_count`).

Model FLOPs per token (PaLM, arXiv 2204.02311 App. B, generalised to every token mixer here):

  forward(context) = 2 N + mixing(context)        train(T) = 3 forward(T)

N is the weights one token multiplies (`matmul_weights`: the attention or Gated DeltaNet
projections, the router, the top-k experts, shared experts, dense MLPs of dense-first layers, the
LM head; not the embedding lookup, norms, biases). `mixing` is the work between tokens:

- softmax attention (GQA, and MLA in its expanded form, as the learner computes it): the scores
  and the value sum over `context` keys, 2 H (d_qk + d_v) context per layer, no causal discount
  (the learner computes every score of a row), so train(T) = 6 N + 6 L H (d_qk + d_v) T, PaLM's
  6 N + 12 L H A T where d_qk = d_v = A;
- Gated DeltaNet: the depthwise causal conv (2 W channels) and the chunked delta rule as
  `gated_deltanet.chunk_gated_delta_rule` computes it, per value head with C the chunk: the
  chunk's k k^T and q k^T (4 C Dk), the unit-triangular solves for the values and the current
  and shared-prefix keys ((C - 1)(Dv + 2 Dk)), the intra-chunk output (2 C Dv) and six
  state products (12 Dk Dv: the state's reads and writes for the row's own state and for a
  shared prompt's, which the packed learner carries); one decoded token (`decode=True`,
  `recurrent_step`) is three state products, 6 Dk Dv. Independent of the context.

`tests/models/test_flops.py` holds these to the matmul FLOPs of the compiled forward of each
tiny family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from espo_jax.models.config import ModelConfig


def gqa_weights(c: ModelConfig) -> int:
    """q (with the output gate's half), k, v, o projections of a GQA layer."""
    q_heads = c.n_heads * (2 if c.attn_output_gate else 1)
    return c.d_model * c.head_dim * (q_heads + 2 * c.n_kv_heads + c.n_heads)


def mla_weights(c: ModelConfig) -> int:
    """Query (full or through the q_lora rank), the latent and rope key, the latent's key and
    value expansion, the output projection of an MLA layer."""
    d, h = c.d_model, c.n_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = d * h * qk if not c.q_lora_rank else d * c.q_lora_rank + c.q_lora_rank * h * qk
    kv = (d * (c.kv_lora_rank + c.qk_rope_head_dim)
          + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim))
    return q + kv + h * c.v_head_dim * d


def linear_attention_weights(c: ModelConfig) -> int:
    """q, k, v, z, b, a and output projections of a Gated DeltaNet layer."""
    d, hv = c.d_model, c.linear_n_value_heads
    qk = c.linear_n_key_heads * c.linear_key_head_dim
    v = hv * c.linear_value_head_dim
    return d * (2 * qk + 2 * v + 2 * hv) + v * d


def moe_weights(c: ModelConfig, experts: int) -> int:
    """Router, `experts` SwiGLU experts, the shared experts (Qwen's gated one with its gate
    vector, DeepSeek's ungated ones)."""
    d = c.d_model
    w = d * c.n_experts + experts * 3 * d * c.d_expert + c.n_shared_experts * 3 * d * c.d_expert
    if c.shared_expert_d_ff:
        w += 3 * d * c.shared_expert_d_ff + d
    return w


def _mixer_weights(c: ModelConfig) -> int:
    return mla_weights(c) if c.attention == "mla" else gqa_weights(c)


def matmul_weights(c: ModelConfig, experts_per_token: int | None = None) -> int:
    """N: weights one token multiplies in a forward pass. `experts_per_token` (default top_k):
    how many routed experts each token runs through (n_experts for the "dense" dispatch)."""
    k = c.top_k if experts_per_token is None else experts_per_token
    n_lin, n_moe = len(c.linear_layers), c.n_moe_layers
    return ((c.n_layers - n_lin) * _mixer_weights(c) + n_lin * linear_attention_weights(c)
            + n_moe * moe_weights(c, k) + (c.n_layers - n_moe) * 3 * c.d_model * c.d_ff
            + c.d_model * c.vocab_size)


def attention_dims(c: ModelConfig) -> tuple[int, int]:
    """(d_qk, d_v): a softmax-attention head's query/key and value widths."""
    if c.attention == "mla":
        return c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    return c.head_dim, c.head_dim


def delta_rule_flops(c: ModelConfig, context: int, decode: bool = False) -> int:
    """One Gated DeltaNet layer's conv and delta-rule FLOPs per token (module docstring)."""
    hv, dk, dv = c.linear_n_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    conv = 2 * c.linear_conv_kernel * (2 * c.linear_n_key_heads * dk + hv * dv)
    if decode:
        return conv + hv * 6 * dk * dv
    ch = min(c.linear_chunk, max(context, 1))
    return conv + hv * (4 * ch * dk + (ch - 1) * (dv + 2 * dk) + 2 * ch * dv + 12 * dk * dv)


def mixing_flops(c: ModelConfig, context: int, decode: bool = False) -> int:
    """FLOPs per token between tokens (scores and value sums, the delta rule) over all layers,
    at `context` visible positions (a training row's width, or a decoded token's cache)."""
    n_lin = len(c.linear_layers)
    qk, v = attention_dims(c)
    return ((c.n_layers - n_lin) * 2 * c.n_heads * (qk + v) * context
            + n_lin * delta_rule_flops(c, context, decode))


def forward_flops_per_token(c: ModelConfig, context: int, decode: bool = False,
                            experts_per_token: int | None = None) -> int:
    """2 N + mixing: one token's forward FLOPs at `context` (`decode`: one generated token
    reading a cache of `context` positions)."""
    return 2 * matmul_weights(c, experts_per_token) + mixing_flops(c, context, decode)


def train_flops_per_token(c: ModelConfig, seq_len: int) -> int:
    """Forward and backward (twice the forward) FLOPs per trained token in rows of `seq_len`."""
    return 3 * forward_flops_per_token(c, seq_len)


def param_count(c: ModelConfig, active: bool = False) -> int:
    """Parameters of the model: the matmul weights with every expert (or, with `active`, the
    top_k a token uses), plus the embedding (when untied), norms, biases, conv kernels and the
    other vectors each family holds."""
    d = c.d_model
    n_lin, n_moe = len(c.linear_layers), c.n_moe_layers
    attn = _mixer_weights(c) + 2 * d  # + the layer's two pre-norms
    if c.attention == "mla":
        attn += c.kv_lora_rank + (c.q_lora_rank or 0)  # the latents' norms
    else:
        if c.qkv_bias:
            attn += c.head_dim * (c.n_heads + 2 * c.n_kv_heads)
        if c.qk_norm:
            attn += 2 * c.head_dim
    hv = c.linear_n_value_heads
    conv = c.linear_conv_kernel * (2 * c.linear_n_key_heads * c.linear_key_head_dim
                                   + hv * c.linear_value_head_dim)
    linear = linear_attention_weights(c) + conv + 2 * hv + c.linear_value_head_dim + 2 * d
    moe = moe_weights(c, c.top_k if active else c.n_experts)
    if c.router == "sigmoid_group":
        moe += c.n_experts  # the correction bias
    total = ((c.n_layers - n_lin) * attn + n_lin * linear + n_moe * moe
             + (c.n_layers - n_moe) * 3 * d * c.d_ff)
    return total + c.vocab_size * d * (1 if c.tie_embeddings else 2) + d
