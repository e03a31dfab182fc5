"""FP8 (E4M3) weights: the per-channel and per-block error bounds, which groups are quantised,
and the measured logit difference and routing flips of the FP8 model against fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.models import get_preset, quant, routing_flip_rate

TINY = get_preset("tiny")


def report(request, line: str) -> None:
    """Print a measurement into the pytest output (also without -s)."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"\n[measured] {line}")


@pytest.fixture(scope="module")
def qparams(tiny_params):
    return quant.quantize_params(tiny_params, TINY)


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(4), (2, 12), 0, TINY.vocab_size)


def test_quantize_kernel_by_hand():
    # amax = 1.0 -> scale = 1/448. 1.0 -> 448 (E4M3 max), -0.5 -> -224 (exact: 1.75 * 2^7),
    # 0.3 -> 134.4 lies in [128, 256) where E4M3 values are 16 apart (3 mantissa bits:
    # 2^7 / 2^3): nearest is 128, so it dequantises to 128/448 = 0.2857.
    q = quant.quantize_kernel(jnp.array([[1.0], [-0.5], [0.3]]))
    np.testing.assert_allclose(q["scale"], [[1 / 448]], rtol=1e-7)
    np.testing.assert_array_equal(q["qvalue"].astype(jnp.float32), [[448.0], [-224.0], [128.0]])
    np.testing.assert_allclose(quant.maybe_dequant(q), [[1.0], [-0.5], [128 / 448]], rtol=1e-6)


def test_quantize_error_within_e4m3_bound_per_channel():
    """Bound: with scale s = amax/448 every scaled value v = w/s has |v| <= 448. E4M3 has 3
    mantissa bits, so for normal v (|v| >= 2^-6) neighbouring values in [2^e, 2^(e+1)) are
    2^(e-3) apart and round-to-nearest errs by at most 2^(e-4) <= 2^-4 |v|; subnormals are
    2^-9 apart (error <= 2^-10). Unscaled: |w - deq(w)| <= 2^-4 |w| + 2^-10 s, which is
    <= 2^-4 amax per output channel (since |w| <= amax and 2^-10 s = amax/(1024*448))."""
    k1, k2 = jax.random.split(jax.random.key(7))
    # channels with magnitudes spread over 8 orders, plus an all-zero channel and experts axis
    mags = 10.0 ** jnp.linspace(-6, 2, 15)
    w = jax.random.normal(k1, (3, 48, 16)) * jnp.concatenate([mags, jnp.zeros(1)])
    w = w.at[1, 5, 3].set(-77.0)  # one outlier in one channel of one expert
    q = quant.quantize_kernel(w)
    assert q["qvalue"].dtype == jnp.float8_e4m3fn and q["scale"].shape == (3, 1, 16)
    err = np.abs(np.asarray(quant.maybe_dequant(q)) - np.asarray(w))
    amax = np.abs(np.asarray(w)).max(axis=1, keepdims=True)
    assert (err <= 2.0 ** -4 * amax).all()
    assert (err <= 2.0 ** -4 * np.abs(np.asarray(w)) + 2.0 ** -10 * np.asarray(q["scale"])
            * (1 + 1e-6)).all()
    np.testing.assert_array_equal(err[..., 15], 0.0)  # zero channel stays exactly zero


def _blocks(shape):
    """Index tuples of every 128x128 tile of the last two axes (edge tiles partial)."""
    rows, cols = shape[-2:]
    return [np.s_[..., i:i + quant.BLOCK, j:j + quant.BLOCK]
            for i in range(0, rows, quant.BLOCK) for j in range(0, cols, quant.BLOCK)]


def test_quantize_blocks_error_within_e4m3_bound_per_block():
    """As per channel (see above) with s = amax(block) / 448 per 128x128 tile: |w - deq(w)| <=
    2^-4 |w| + 2^-10 s <= 2^-4 amax(block). Tiles of [2, 300, 200]: 3 x 2 per expert, edge
    tiles 44 rows / 72 columns; magnitudes differ by tile, one tile is all zero."""
    w = np.array(jax.random.normal(jax.random.key(8), (2, 300, 200)))
    for n, tile in enumerate(_blocks(w.shape)):
        w[tile] *= 10.0 ** (n - 4)  # 1e-4 ... 10 across the six tiles
    w[1, 128:256, 0:128] = 0.0  # expert 1's tile (1, 0)
    q = quant.quantize_kernel_blocks(w)
    assert q["qvalue"].dtype == jnp.float8_e4m3fn and q["scale"].shape == (2, 3, 2)
    deq, scale = np.asarray(quant.maybe_dequant(q)), np.asarray(q["scale"])
    for n, tile in enumerate(_blocks(w.shape)):
        i, j = divmod(n, 2)
        amax = np.abs(w[tile]).max(axis=(-2, -1))  # per expert
        s = scale[:, i, j]
        np.testing.assert_allclose(s, np.where(amax > 0, amax / 448, 1.0), rtol=2.4e-7)  # 2 ulp
        err = np.abs(deq[tile] - w[tile])
        assert (err <= 2.0 ** -4 * amax[:, None, None]).all()
        assert (err <= 2.0 ** -4 * np.abs(w[tile]) + 2.0 ** -10 * s[:, None, None]
                * (1 + 1e-6)).all()
    np.testing.assert_array_equal(deq[1, 128:256, 0:128], 0.0)  # the zero tile stays zero


def test_a_block_quantises_on_its_own():
    """A tile's E4M3 values and scale depend on that tile alone: an outlier coarsens its own
    tile, while per-channel scales coarsen its whole column. Outlier 1e5 -> channel scale
    1e5/448 = 223; the column's other values (|w| < 0.22) then scale below 2^-10, half the
    smallest E4M3 subnormal, and all round to zero."""
    w = np.array(jax.random.normal(jax.random.key(9), (300, 200))) * 1e-2
    w[5, 7] = 1e5  # outlier in tile (0, 0), column 7
    q = quant.quantize_kernel_blocks(w)
    alone = quant.quantize_kernel_blocks(w[128:256, 0:128])  # tile (1, 0), same columns
    np.testing.assert_array_equal(q["qvalue"][128:256, 0:128], alone["qvalue"])
    np.testing.assert_array_equal(q["scale"][1, 0], alone["scale"][0, 0])
    col = w[128:256, 7]
    block_err = np.abs(np.asarray(quant.maybe_dequant(q))[128:256, 7] - col)
    assert (block_err <= 2.0 ** -4 * np.abs(col) + 2.0 ** -10 * float(q["scale"][1, 0])).all()
    assert np.abs(col).max() < 2.0 ** -10 * 1e5 / 448
    np.testing.assert_array_equal(quant.maybe_dequant(quant.quantize_kernel(w))[128:256, 7], 0.0)


def test_expand_scale_by_hand():
    # a [130, 1] kernel in 128x128 tiles: rows 0..127 take scale 2, rows 128, 129 scale 3; a
    # per-channel [1, 3] scale broadcasts as it is.
    full = quant.expand_scale(jnp.array([[2.0], [3.0]]), (130, 1))
    np.testing.assert_array_equal(full[:, 0], [2.0] * 128 + [3.0] * 2)
    assert quant.expand_scale(jnp.ones((1, 3)), (130, 3)).shape == (1, 3)
    with pytest.raises(ValueError, match=r"scale shape \(3, 1\) fits neither channel nor "
                                         r"128x128 block scales of a kernel of shape \(130, 1\)"):
        quant.expand_scale(jnp.ones((3, 1)), (130, 1))


def test_groups_router_and_lm_head_stay_float(tiny_params, qparams):
    moe = qparams["layers_0"]["moe"]
    assert not quant.is_quantized(moe["router"]["kernel"])
    np.testing.assert_array_equal(moe["router"]["kernel"], tiny_params["layers_0"]["moe"]
                                  ["router"]["kernel"])
    assert not quant.is_quantized(qparams["lm_head"]["kernel"])
    assert not quant.is_quantized(qparams["embed"]["embedding"])
    assert moe["wi_gate"]["scale"].shape == (8, 1, 32)  # per expert, per output channel
    q_proj = qparams["layers_0"]["attn"]["q_proj"]["kernel"]
    assert q_proj["qvalue"].dtype == jnp.float8_e4m3fn and q_proj["scale"].shape == (1, 64)
    assert qparams["layers_0"]["attn_norm"]["scale"].dtype == jnp.float32
    # bytes: 4-byte floats of quantised kernels become 1 byte + scales
    assert quant.param_bytes(qparams) < 0.4 * quant.param_bytes(tiny_params)
    with pytest.raises(ValueError, match=r"unknown quantisation groups \['experts_x'\]; valid"):
        quant.quantize_params(tiny_params, TINY, groups=("experts_x",))
    all_q = quant.quantize_params(tiny_params, TINY, groups=quant.GROUPS)
    assert quant.is_quantized(all_q["layers_1"]["moe"]["router"]["kernel"])
    assert all_q["embed"]["embedding"]["scale"].shape == (128, 1)  # one scale per token row
    blocks = quant.quantize_params(tiny_params, TINY, scheme="block")
    assert blocks["layers_0"]["moe"]["wi_gate"]["scale"].shape == (8, 1, 1)  # [64, 32]: 1 tile
    assert not quant.is_quantized(blocks["layers_0"]["moe"]["router"]["kernel"])
    with pytest.raises(ValueError, match=r"unknown quantisation scheme 'tile'; valid schemes: "
                                         r"\('channel', 'block'\)"):
        quant.quantize_params(tiny_params, TINY, scheme="tile")


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_fp8_forward_dequantises_on_the_fly(fwd, tiny_params, tokens, scheme):
    """A tree with every group quantised (embedding, router and LM head included) through
    `forward` equals its dequantised float copy: every kernel read goes through
    `maybe_dequant`."""
    all_q = quant.quantize_params(tiny_params, TINY, groups=quant.GROUPS, scheme=scheme)
    a = fwd(TINY, all_q, tokens)
    b = fwd(TINY, quant.dequantize_params(all_q), tokens)
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-6)
    assert np.abs(np.asarray(a.logits - fwd(TINY, tiny_params, tokens).logits)).max() > 0


def test_fp8_vs_fp32_logits_and_routing_flips(request, fwd, tiny_params, qparams, tokens):
    ref = fwd(TINY, tiny_params, tokens)
    out = fwd(TINY, qparams, tokens)
    diff = np.abs(np.asarray(out.logits - ref.logits))
    rel_rms = np.sqrt(np.mean(diff ** 2) / np.mean(np.asarray(ref.logits) ** 2))
    flips = np.asarray(routing_flip_rate(out.routed_experts, ref.routed_experts))
    report(request, f"FP8 vs fp32 (tiny, 2x12 tokens): max |dlogit| {diff.max():.4g}, "
                    f"mean {diff.mean():.4g}, relative RMS {rel_rms:.4g}; routing flip rate "
                    f"per MoE layer {[f'{x:.4f}' for x in flips]}")
    assert diff.max() > 0  # FP8 really changes the model
    # Envelope: each quantised matmul perturbs its output by at most ~2^-4 relative; about
    # 2 layers x 5 quantised matmuls on the path add up (first order) to < 10 * 2^-4 = 0.625.
    assert rel_rms < 0.625
    assert ((flips >= 0) & (flips <= 1)).all()
    # Router replay of the fp32 routing removes the flips (R3 for FP8 rollouts)
    replayed = fwd(TINY, qparams, tokens, routed_experts_BxTxMxk=ref.routed_experts)
    np.testing.assert_array_equal(routing_flip_rate(replayed.routed_experts, ref.routed_experts),
                                  [0.0, 0.0])


def test_routing_flip_rate_by_hand():
    # token 0: {0,1} vs {1,0} same set; token 1: {2,3} vs {2,4} flip; token 2: same. Layer 1
    # all flip. Mask drops token 2 in the second call: layer 0 -> 1/2.
    a = jnp.array([[[0, 1], [5, 6]], [[2, 3], [5, 6]], [[4, 5], [5, 6]]])
    b = jnp.array([[[1, 0], [0, 1]], [[2, 4], [0, 1]], [[4, 5], [0, 1]]])
    np.testing.assert_allclose(routing_flip_rate(a, b), [1 / 3, 1.0])
    np.testing.assert_allclose(routing_flip_rate(a, b, jnp.array([True, True, False])),
                               [0.5, 1.0])
