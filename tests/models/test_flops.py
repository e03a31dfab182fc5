"""The one parameter and FLOP model (`espo_jax.models.flops`): by hand on `tiny`, and against
the matmul FLOPs of the forward program each tiny family lowers to.

The count is of the program JAX hands XLA (StableHLO): each `dot_general` (2 x output elements x
contracted size) and each unit-triangular solve (m (m - 1) x right-hand sides; a LAPACK call on
the CPU). The compiled program's `cost_analysis()` total is not the right yardstick: it adds the
elementwise work (norms, softmax, gates), and after XLA folds the delta rule's products with the
zero initial state it drops work the model does on every later chunk.
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest

from espo_jax.models import flops, forward, get_preset, init_params

T = 8  # one delta-rule chunk of the hybrid tinies (linear_chunk 8): its scan runs once

DOT = re.compile(r"stablehlo\.dot_general .*contracting_dims = \[([\d, ]*)\] x .*"
                 r": \(tensor<([\dx]+)x\w+>, tensor<[^>]+>\) -> tensor<([\dx]+)x\w+>")
TRSM = re.compile(r"custom_call @\w*trsm\w*\(.*: \(tensor<([\dx]+)x\w+>, tensor<[^>]+>\) "
                  r"-> tensor<([\dx]+)x\w+>")


def _shape(s: str) -> list[int]:
    return [int(x) for x in s.split("x")]


def matmul_flops_of_program(text: str) -> int:
    total = 0
    for line in text.splitlines():
        if m := DOT.search(line):
            con = [int(i) for i in m[1].split(",") if i.strip()]
            lhs, out = _shape(m[2]), _shape(m[3])
            total += 2 * math.prod(out) * math.prod(lhs[i] for i in con)
        elif m := TRSM.search(line):
            a, out = _shape(m[1]), _shape(m[2])
            total += math.prod(out) * (a[-1] - 1)
    return total


def test_tiny_by_hand():
    # tiny: d 64, |V| 128, 2 layers, 4 query / 2 kv heads of 16, top 2 of 8 experts of 32.
    # Per layer: q, k, v, o 64*16*(4+2+2+4) = 12288, router 64*8 = 512, two experts
    # 2*3*64*32 = 12288: 25088; two layers 50176 + LM head 128*64 = 8192: N = 58368.
    # Scores and values: 2 layers * 2 * 4 heads * (16 + 16) = 512 per key.
    c = get_preset("tiny")
    assert flops.matmul_weights(c) == 58368
    assert flops.forward_flops_per_token(c, 10) == 2 * 58368 + 512 * 10
    assert flops.train_flops_per_token(c, 10) == 6 * 58368 + 1536 * 10  # PaLM's 6N + 12LHAT
    # The parameters add the embedding (128*64), two norms per layer and q/k norms (2*(128+32)),
    # the final norm (64), and the six experts each layer's token skips (6*3*64*32*2 layers).
    assert flops.param_count(c, active=True) == 58368 + 8192 + 320 + 64
    assert flops.param_count(c) == flops.param_count(c, active=True) + 6 * 3 * 64 * 32 * 2


@pytest.mark.parametrize("preset", ["tiny", "tiny_deepseek_v3", "tiny_glm45", "tiny_qwen3_next",
                                    "tiny_qwen35_moe"])
def test_forward_flops_equal_the_programs_matmuls(preset):
    # "dense" dispatch runs every expert on every token (E per token, not top_k) and combines
    # them with a gates x outputs product (2 E D per token per MoE layer) the model counts as
    # no matmul; the Gated DeltaNet's causal conv is elementwise here (2 W channels per token).
    c = get_preset(preset, dispatch="dense")
    params = jax.eval_shape(lambda: init_params(c, jax.random.key(0)))
    lowered = jax.jit(lambda p, t: forward(c, p, t).logits).lower(
        params, jax.ShapeDtypeStruct((1, T), jnp.int32))
    counted = matmul_flops_of_program(lowered.as_text())
    combine = 2 * c.n_experts * c.d_model * c.n_moe_layers
    conv = 2 * c.linear_conv_kernel * len(c.linear_layers) * (
        2 * c.linear_n_key_heads * c.linear_key_head_dim
        + c.linear_n_value_heads * c.linear_value_head_dim)
    model = flops.forward_flops_per_token(c, T, experts_per_token=c.n_experts)
    assert counted == T * (model + combine - conv)
