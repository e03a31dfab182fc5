"""Gated DeltaNet: the chunked parallel form equals the token-by-token recurrence (values, final
state and gradients) for several chunk sizes, with segment boundaries inside and on chunk edges;
a packed row equals its sequences run alone; a cached prefill + decode equals the uncached
forward (tiny_qwen3_next, both layer kinds)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.delta_rule import recurrent_gated_delta_rule
from helpers.fp32 import fp32_bound

from espo_jax import models
from espo_jax.models import gated_deltanet as gd

B, T, H, K, V = 2, 29, 3, 8, 6


@functools.cache
def _inputs():
    r = np.random.default_rng(0)
    q = gd.l2norm(jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32)) * K ** -0.5
    k = gd.l2norm(jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32))
    v = jnp.asarray(r.normal(size=(B, T, H, V)), jnp.float32)
    g = -jnp.asarray(r.uniform(0, 1.5, size=(B, T, H)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, H)), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, 5:] = 2  # inside the first chunk of 8 (and of 3: at 5)
    seg[0, 16:] = 3  # on a chunk edge of 8
    seg[0, 17:] = 4  # a one-token segment
    seg[1, 25:] = 0  # padding at the end
    s0 = jnp.asarray(r.normal(size=(B, H, K, V)), jnp.float32)
    return q, k, v, g, beta, jnp.asarray(seg), s0


def _shared_prefix_segments():
    """Row 0: group 1's prefix (5 tokens) and members of 4, 7, 1 tokens, then group 2's prefix
    (3) and one member (6), then padding; row 1: a plain segment, then group 3 (prefix 8, members
    of 9 and 2). Boundaries inside chunks and on their edges (chunk 8: index 16, 24)."""
    s = 1 << 16
    row0 = [s] * 5 + [s + 1] * 4 + [s + 2] * 7 + [s + 3] + [2 * s] * 3 + [2 * s + 1] * 6 + [0] * 3
    row1 = [1] * 8 + [3 * s] * 8 + [3 * s + 1] * 9 + [3 * s + 2] * 2 + [0] * 2
    return jnp.asarray([row0[:T], row1[:T]], jnp.int32)


def _loss(fn, q, k, v, g, beta, seg, s0):
    o, s = fn(q, k, v, g, beta, seg, s0)
    w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    return jnp.sum(o * w) + jnp.sum(jnp.sin(s))


@pytest.mark.parametrize("segments", ["plain", "shared_prefix"])
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_equals_recurrent_values_and_gradients(chunk, segments):
    args = _inputs()
    if segments == "shared_prefix":
        args = args[:5] + (_shared_prefix_segments(), args[6])
    chunked = functools.partial(gd.chunk_gated_delta_rule, chunk=chunk)
    chunked_fn = lambda q, k, v, g, b, s, s0: chunked(q, k, v, g, b, s, state_BxHxKxV=s0)
    o_c, s_c = jax.jit(chunked_fn)(*args)
    o_r, s_r = jax.jit(recurrent_gated_delta_rule)(*args)
    np.testing.assert_allclose(o_c, o_r, atol=2e-6, rtol=0)
    np.testing.assert_allclose(s_c, s_r, atol=2e-6, rtol=0)
    argnums = (0, 1, 2, 3, 4, 6)
    g_c = jax.jit(jax.grad(functools.partial(_loss, chunked_fn), argnums))(*args)
    g_r = jax.jit(jax.grad(functools.partial(_loss, recurrent_gated_delta_rule),
                           argnums))(*args)
    for a, b in zip(g_c, g_r, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


@pytest.mark.parametrize("chunk", [3, 8])
def test_shared_prefix_members_continue_the_prefix_state(chunk):
    """Members of a shared prefix's group start from the state after the prefix (not after the
    member before them): chunked == recurrent, and a member's outputs equal those of its
    prefix followed by that member alone."""
    q, k, v, g, beta, _, s0 = _inputs()
    seg = _shared_prefix_segments()
    o_c, s_c = gd.chunk_gated_delta_rule(q, k, v, g, beta, seg, chunk, s0)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, seg, s0)
    np.testing.assert_allclose(o_c, o_r, atol=2e-6, rtol=0)
    np.testing.assert_allclose(s_c, s_r, atol=2e-6, rtol=0)
    # member 2 of group 1 (row 0, tokens 9..15) alone after its prefix (tokens 0..4; the
    # prefix opens the row, so it starts from the initial state)
    take = np.r_[0:5, 9:16]
    alone, _ = recurrent_gated_delta_rule(*(x[:1, take] for x in (q, k, v, g, beta)),
                                             jnp.ones((1, 12), jnp.int32), s0[:1])
    np.testing.assert_allclose(o_c[0, 9:16], alone[0, 5:], atol=2e-6, rtol=0)


def test_segment_boundaries_reset_the_state():
    """Tokens after a boundary do not depend on tokens before it; the initial state reaches only
    the first segment."""
    q, k, v, g, beta, seg, s0 = _inputs()
    o, _ = gd.chunk_gated_delta_rule(q, k, v, g, beta, seg, 8, s0)
    v2 = v.at[0, :5].add(1.0)  # change segment 1 of row 0
    o2, _ = gd.chunk_gated_delta_rule(q, k, v2, g, beta, seg, 8, s0)
    np.testing.assert_array_equal(o[0, 5:], o2[0, 5:])
    assert np.abs(np.asarray(o[0, :5] - o2[0, :5])).max() > 1e-3
    o3, _ = gd.chunk_gated_delta_rule(q, k, v, g, beta, seg, 8, None)
    np.testing.assert_array_equal(o[0, 5:], o3[0, 5:])
    assert np.abs(np.asarray(o[0, :5] - o3[0, :5])).max() > 1e-3


def test_causal_conv_reads_only_its_segment():
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(1, 6, 2)), jnp.float32)
    kernel = jnp.asarray(r.normal(size=(3, 2)), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2]])
    out, _ = gd.causal_conv(x, kernel, seg)
    # token 4 (segment 2, second token): kernel[1] * x3 + kernel[2] * x4 (x2 is segment 1)
    pre = kernel[1] * x[0, 3] + kernel[2] * x[0, 4]
    np.testing.assert_allclose(out[0, 4], jax.nn.silu(pre), rtol=1e-6)
    # token 2 (segment 1): the full window x0, x1, x2
    pre = kernel[0] * x[0, 0] + kernel[1] * x[0, 1] + kernel[2] * x[0, 2]
    np.testing.assert_allclose(out[0, 2], jax.nn.silu(pre), rtol=1e-6)


@functools.cache
def _longest_reduction(config, tokens: int) -> int:
    """The most products one output sums: a model width, an MLP's, or a linear layer's output
    at the last of `tokens` tokens, which reads its state, a sum over every earlier token's
    k v^T: tokens x Dk."""
    return max(config.d_model, config.d_ff, config.d_expert,
               tokens * config.linear_key_head_dim)


def _model():
    config = models.get_preset("tiny_qwen3_next")

    @jax.jit
    def init(key):
        params = models.init_params(config, key)
        # A_log, dt_bias and the norms away from their init so every term matters
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        leaves = [x + 0.2 * jax.random.normal(kk, x.shape, x.dtype)
                  for x, kk in zip(leaves, keys, strict=True)]
        return jax.tree.unflatten(tree, leaves)

    return config, init(jax.random.key(0))


def test_packed_rows_equal_sequences_alone():
    """Row 0 packs three sequences (boundaries at 13 and 19: inside chunks of 8), row 4 a shared
    prefix of 7 tokens and two members of 8 and 10 (`attention.PREFIX_STRIDE` ids, positions
    continuing the prefix's); rows 1-3 and 5-6 hold each sequence alone, right-padded (one
    batch, one compile)."""
    config, params = _model()
    r = np.random.default_rng(2)
    width, stride = 32, 1 << 16
    toks, seg, pos = (np.zeros((7, width), np.int32) for _ in range(3))
    lens = (13, 6, 11)
    seqs = [r.integers(0, config.vocab_size, n) for n in lens]
    start = 0
    for i, (s, n) in enumerate(zip(seqs, lens, strict=True)):
        toks[0, start:start + n], seg[0, start:start + n] = s, i + 1
        pos[0, start:start + n] = np.arange(n)
        toks[i + 1, :n], seg[i + 1, :n], pos[i + 1, :n] = s, 1, np.arange(n)
        start += n
    prefix, members = r.integers(0, config.vocab_size, 7), [
        r.integers(0, config.vocab_size, n) for n in (8, 10)]
    toks[4, :7], seg[4, :7], pos[4, :7] = prefix, stride, np.arange(7)
    start = 7
    for m, s in enumerate(members):
        n = len(s)
        toks[4, start:start + n], seg[4, start:start + n] = s, stride + m + 1
        pos[4, start:start + n] = 7 + np.arange(n)
        toks[5 + m, :7 + n], seg[5 + m, :7 + n] = np.r_[prefix, s], 1
        pos[5 + m, :7 + n] = np.arange(7 + n)
        start += n
    logits = jax.jit(functools.partial(models.forward, config))(
        params, toks, positions_BxT=pos, segment_ids_BxT=seg).logits
    start = 0
    for i, n in enumerate(lens):
        np.testing.assert_allclose(logits[0, start:start + n], logits[i + 1, :n], atol=5e-5,
                                   rtol=0)  # fp32 summation order (2e-5 seen)
        start += n
    np.testing.assert_allclose(logits[4, :7], logits[5, :7], atol=5e-5, rtol=0)
    np.testing.assert_allclose(logits[4, 7:15], logits[5, 7:15], atol=5e-5, rtol=0)
    np.testing.assert_allclose(logits[4, 15:25], logits[6, 7:17], atol=5e-5, rtol=0)


def test_cached_prefill_and_decode_equal_the_full_forward():
    """Right-padded prompts prefilled through the cache (chunked form with the padding left
    out of the state and conv window), then one token at a time (recurrent form): each step's
    logits equal the uncached forward's at that position, within the fp32 bound of two summation
    orders (helpers/fp32.py): 4 layers x the longest reduction x eps x max |logit| (~6). A
    linear layer's output at token t sums t x Dk products (its state holds every earlier
    token's k v^T), so the longest reduction is 30 tokens x Dk 16 = 480: ~1.4e-3 (seen 1.5e-5
    on an AMD EPYC with AVX-512, 3.5e-5 on one without)."""
    config, params = _model()
    r = np.random.default_rng(3)
    n_total, p = 30, 20
    toks = r.integers(0, config.vocab_size, (2, n_total))
    lengths = np.array([20, 13])
    full = jax.jit(functools.partial(models.forward, config))(params, toks).logits
    full_short = jax.jit(functools.partial(models.forward, config))(
        params, toks[1:, :13 + 10]).logits
    atol = fp32_bound(config.n_layers, _longest_reduction(config, n_total), np.max(np.abs(full)))
    s = 40
    cache = models.init_cache(config, 2, s)
    valid = np.arange(p)[None] < lengths[:, None]
    prompt = np.where(valid, toks[:, :p], 0)
    fwd = jax.jit(functools.partial(models.forward, config))
    out = fwd(params, prompt, attention_mask_BxT=valid, cache=cache,
              cache_mask_BxS=np.zeros((2, s), bool))
    np.testing.assert_allclose(out.logits[0], full[0, :p], atol=atol, rtol=0)
    np.testing.assert_allclose(out.logits[1, :13], full_short[0, :13], atol=atol, rtol=0)
    cache, mask = out.cache, np.arange(s)[None] < lengths[:, None]
    pos = lengths.copy()
    for _ in range(10):
        feed = np.array([toks[0, pos[0]], toks[1, pos[1]]])[:, None]
        out = fwd(params, feed, positions_BxT=pos[:, None], cache=cache, cache_mask_BxS=mask)
        np.testing.assert_allclose(out.logits[0, 0], full[0, pos[0]], atol=atol, rtol=0)
        np.testing.assert_allclose(out.logits[1, 0], full_short[0, pos[1]], atol=atol, rtol=0)
        mask = mask | (np.arange(s)[None] == pos[:, None])
        cache, pos = out.cache, pos + 1


def test_cache_memory_per_slot():
    """A linear layer's cache per slot: (W - 1) conv inputs of q, k and v plus the fp32 state,
    independent of the cache length; a full-attention layer's grows with it."""
    config = models.get_preset("tiny_qwen3_next")
    w, qk, v = 3, 2 * 8, 4 * 8
    for s in (16, 64):
        cache = models.init_cache(config, 1, s)
        lin = sum(x.nbytes for x in cache["layers_0"].values())
        assert lin == 4 * (w * (2 * qk + v)) + 4 * 4 * 8 * 8
        full = sum(x.nbytes for x in cache["layers_1"].values())
        assert full == 4 * 2 * 2 * 16 * s  # k and v: K=2 heads of 16, fp32
    real = models.get_preset("qwen3_next_80b_a3b")
    shapes = jax.eval_shape(lambda: models.init_cache(real, 1, 1))
    lin = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes["layers_0"]))
    assert lin == 3 * (2 * 2048 + 4096) * 2 + 32 * 128 * 128 * 4 == 2_146_304


def test_router_replay_reproduces_the_forward():
    """Replaying the recorded routes (R3) gives the same logits; forced routes are used."""
    config, params = _model()
    toks = np.random.default_rng(4).integers(0, config.vocab_size, (2, 12))
    fwd = jax.jit(functools.partial(models.forward, config))
    shape = (2, 12, config.n_moe_layers, config.top_k)
    live = fwd(params, toks, routed_experts_BxTxMxk=np.full(shape, -1, np.int32))
    replayed = fwd(params, toks, routed_experts_BxTxMxk=live.routed_experts)
    np.testing.assert_array_equal(live.logits, replayed.logits)
    forced = (np.asarray(live.routed_experts) + 1) % config.n_experts
    out = fwd(params, toks, routed_experts_BxTxMxk=forced)
    np.testing.assert_array_equal(out.routed_experts, forced)
    # the first MoE layer's own choice sees unchanged inputs (later ones see forced outputs)
    np.testing.assert_array_equal(out.own_experts[:, :, 0], live.routed_experts[:, :, 0])
    assert np.abs(np.asarray(out.logits - live.logits)).max() > 1e-3


def test_linear_heads_shard_on_tensor_and_forward_matches_one_device():
    from espo_jax import sharding

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets 8 fake CPU devices)")

    class Mesh:
        data, fsdp, expert, tensor = 2, 1, 2, 2

    config, params = _model()
    mesh = sharding.make_mesh(Mesh, jax.devices()[:8])
    shardings = sharding.param_shardings(config, mesh)
    lin = shardings["layers_0"]["linear_attn"]
    assert lin["conv_q"].spec == jax.sharding.PartitionSpec(None, "tensor")
    assert lin["v_proj"]["kernel"].spec == jax.sharding.PartitionSpec(("fsdp", "expert"),
                                                                       "tensor")
    assert lin["A_log"].spec == jax.sharding.PartitionSpec("tensor")
    placed = jax.device_put(params, shardings)
    assert placed["layers_0"]["linear_attn"]["conv_v"].addressable_shards[0].data.shape == (4, 16)
    toks = np.random.default_rng(5).integers(0, config.vocab_size, (4, 12))
    fwd = jax.jit(functools.partial(models.forward, config))
    # The split heads and batch sum in other orders: within the fp32 bound (helpers/fp32.py) of
    # 4 layers x 12 tokens x Dk 16 x eps x max |logit| (~5): ~4.6e-4 (seen 2.5e-5 on an AMD EPYC
    # with AVX-512, 2.1e-4 on a Zen 1 EPYC with AVX2).
    one = fwd(params, toks).logits
    atol = fp32_bound(config.n_layers, _longest_reduction(config, toks.shape[1]),
                      np.max(np.abs(one)))
    np.testing.assert_allclose(fwd(placed, toks).logits, one, atol=atol, rtol=0)
