"""Model: config validation, parameter tree, forward semantics, dispatch exactness, aux losses."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.models import (
    ModelConfig,
    attention,
    forward,
    get_preset,
    init_cache,
    init_params,
    lm_head_kernel,
    router,
)
from espo_jax.models.flops import param_count
from espo_jax.models.moe_dispatch import (
    capacity_dispatch,
    dense_dispatch,
    dropless_dispatch,
    expert_ffn,
    first_block_size,
    looped_dispatch,
    ragged_dispatch,
)

TINY = get_preset("tiny")


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (2, 12), 0, TINY.vocab_size)


def shapes(tree):
    return jax.tree_util.tree_map(lambda x: tuple(x.shape), tree)


def abstract_params(cfg):
    return jax.eval_shape(lambda r: init_params(cfg, r), jax.random.key(0))


# ---- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(n_heads=4, n_kv_heads=3), "n_heads (4) must be divisible by n_kv_heads (3)"),
        (dict(top_k=9), "top_k must be in [1, n_experts=8], got 9"),
        (dict(dispatch="sparse"), "dispatch 'sparse' is not one of"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(dtype="float64"), "dtype 'float64' is not one of"),
        (dict(attention_chunk=-1), "attention_chunk must be >= 0 (0: unchunked), got -1"),
        (dict(aux_loss_tokens="padded"), "aux_loss_tokens 'padded' is not one of ('real', 'all')"),
    ],
)
def test_config_rejects_bad_values(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        TINY.replace(**changes)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="valid presets: .*'tiny'.*'qwen3_235b_a22b'"):
        get_preset("huge")


def test_qwen_presets_have_the_published_sizes():
    c30 = get_preset("qwen3_30b_a3b")
    c235 = get_preset("qwen3_235b_a22b")
    # Qwen3-30B-A3B: 30.5B total / 3.3B active; Qwen3-235B-A22B: 235B total / 22B active
    # (Qwen3 technical report). The formula counts every weight tensor.
    assert 30.0e9 < param_count(c30) < 31.0e9
    assert 3.2e9 < param_count(c30, active=True) < 3.4e9
    assert 234e9 < param_count(c235) < 236e9
    assert 21.5e9 < param_count(c235, active=True) < 22.5e9
    assert c30.moe_layers == tuple(range(48))


# ---- parameter tree ---------------------------------------------------------------------------
def test_param_tree_matches_contract(params):
    s = shapes(params)
    assert set(s) == {"embed", "final_norm", "lm_head", "layers_0", "layers_1"}
    assert s["embed"] == {"embedding": (128, 64)}
    assert s["lm_head"] == {"kernel": (64, 128)}
    layer = s["layers_1"]
    assert layer["attn"] == {
        "q_proj": {"kernel": (64, 4 * 16)}, "k_proj": {"kernel": (64, 2 * 16)},
        "v_proj": {"kernel": (64, 2 * 16)}, "o_proj": {"kernel": (4 * 16, 64)},
        "q_norm": {"scale": (16,)}, "k_norm": {"scale": (16,)},
    }
    assert layer["moe"] == {"router": {"kernel": (64, 8)}, "wi_gate": (8, 64, 32),
                            "wi_up": (8, 64, 32), "wo": (8, 32, 64)}
    assert layer["attn_norm"] == layer["mlp_norm"] == {"scale": (64,)}


def test_variant_trees_and_param_counts():
    cfg = TINY.replace(moe_every=2, shared_expert_d_ff=24, tie_embeddings=True, qkv_bias=True,
                       qk_norm=False)
    p = abstract_params(cfg)
    s = shapes(p)
    assert "lm_head" not in s
    assert s["layers_0"]["mlp"] == {"gate_proj": {"kernel": (64, 128)},
                                    "up_proj": {"kernel": (64, 128)},
                                    "down_proj": {"kernel": (128, 64)}}
    assert "moe" not in s["layers_0"] and "mlp" not in s["layers_1"]
    assert s["layers_1"]["moe"]["shared_expert"]["down_proj"] == {"kernel": (24, 64)}
    assert s["layers_1"]["moe"]["shared_expert_gate"] == {"kernel": (64, 1)}
    assert s["layers_1"]["attn"]["q_proj"]["bias"] == (64,)
    assert "q_norm" not in s["layers_1"]["attn"]
    assert cfg.moe_layers == (1,)
    for c, tree in ((cfg, p), (TINY, abstract_params(TINY))):
        assert param_count(c) == sum(x.size for x in jax.tree_util.tree_leaves(tree))
    # tiny by hand: attention 64*16*(4+2+2) + 64*64 + 2*64 (norms) + 2*16 (q/k norm) = 12448;
    # MoE 64*8 + 8*3*64*32 = 49664; per layer 62112, 2 layers 124224; embed + head 2*128*64
    # = 16384; final norm 64: total 140672.
    assert param_count(TINY) == 140672


# ---- forward semantics ------------------------------------------------------------------------
def test_forward_shapes_and_metrics(params, tokens, fwd):
    out = fwd(TINY, params, tokens)
    assert out.logits.shape == (2, 12, 128) and out.logits.dtype == jnp.float32
    assert out.routed_experts.shape == (2, 12, 2, 2) and out.routed_experts.dtype == jnp.int32
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (2, 12, 8)
    assert out.hidden is None and out.cache is None
    assert np.isfinite(out.logits).all()
    # the top-k of the returned router logits are the routed experts (no replay)
    top = jax.lax.top_k(out.router_logits[1], 2)[1]
    np.testing.assert_array_equal(np.sort(top, -1), np.sort(out.routed_experts[:, :, 1], -1))
    lb, z = out.metrics["moe/load_balance_loss"], out.metrics["moe/z_loss"]
    # the metrics are the layer means of the per-layer losses of the returned routing
    lbs = [router.load_balance_loss(out.router_logits[m].reshape(24, 8),
                                    out.routed_experts[:, :, m].reshape(24, 2)) for m in range(2)]
    zs = [router.z_loss(out.router_logits[m].reshape(24, 8)) for m in range(2)]
    np.testing.assert_allclose(lb, np.mean(lbs), rtol=1e-6)
    np.testing.assert_allclose(z, np.mean(zs), rtol=1e-6)
    assert out.metrics["moe/dropped_frac"] == 0.0
    np.testing.assert_allclose(out.aux_loss, 0.001 * lb, rtol=1e-6)  # z_loss_coef is 0


def test_aux_losses_over_real_tokens_or_all_positions(params, tokens, fwd):
    """`aux_loss_tokens`: "real" averages the load-balancing and z-losses over real tokens at
    their weights (a shared prompt's token stands for several), "all" over every position,
    padding at weight 1; the routing itself is the same."""
    segments = jnp.array([[1] * 12, [1] * 8 + [0] * 4])  # row 1 ends in 4 padding positions
    # `RLBatch.token_weights`: 0 on padding; a prompt shared by 3 responses counts 3 times
    weights = jnp.where(segments > 0, 1.0, 0.0).at[0, :3].set(3.0)
    cfg = TINY.replace(z_loss_coef=0.01)
    counted = {"real": weights.reshape(-1),
               "all": jnp.where(segments > 0, weights, 1.0).reshape(-1)}
    for tokens_counted, w in counted.items():
        out = fwd(cfg.replace(aux_loss_tokens=tokens_counted), params, tokens,
                  segment_ids_BxT=segments, token_weights_BxT=weights)
        logits = [out.router_logits[m].reshape(24, 8) for m in range(2)]
        lb = np.mean([router.load_balance_loss(lg, out.routed_experts[:, :, m].reshape(24, 2), w)
                      for m, lg in enumerate(logits)])
        z = np.mean([router.z_loss(lg, w) for lg in logits])
        np.testing.assert_allclose(out.metrics["moe/load_balance_loss"], lb, rtol=1e-6)
        np.testing.assert_allclose(out.metrics["moe/z_loss"], z, rtol=1e-6)
        np.testing.assert_allclose(out.aux_loss, 0.001 * lb + 0.01 * z, rtol=1e-6)
        if tokens_counted == "real":
            real_lb, real_routing = lb, out.routed_experts
    assert abs(lb - real_lb) > 1e-4  # the padding positions moved it
    np.testing.assert_array_equal(out.routed_experts, real_routing)
    # without token weights (unpacked rows): "all" is the plain mean over the 24 positions
    out = fwd(cfg.replace(aux_loss_tokens="all"), params, tokens, segment_ids_BxT=segments)
    np.testing.assert_allclose(out.metrics["moe/load_balance_loss"], np.mean(
        [router.load_balance_loss(out.router_logits[m].reshape(24, 8),
                                  out.routed_experts[:, :, m].reshape(24, 2)) for m in range(2)]),
        rtol=1e-6)


def test_wrong_shapes_are_rejected(params, tokens, fwd):
    with pytest.raises(ValueError, match=r"routed_experts_BxTxMxk has shape \(2, 12, 1, 2\), "
                                         r"expected \(2, 12, 2, 2\)"):
        fwd(TINY, params, tokens, routed_experts_BxTxMxk=jnp.zeros((2, 12, 1, 2), int))
    with pytest.raises(ValueError, match="tokens_BxT must be"):
        fwd(TINY, params, tokens[0])


def test_causal(params, tokens, fwd):
    a = fwd(TINY, params, tokens).logits
    changed = tokens.at[:, 7:].set((tokens[:, 7:] + 1) % TINY.vocab_size)
    b = fwd(TINY, params, changed).logits
    np.testing.assert_array_equal(a[:, :7], b[:, :7])
    assert np.abs(a[:, 7:] - b[:, 7:]).max() > 1e-3


def test_left_padding_with_attention_mask(params, tokens, fwd):
    """Row 1 = 3 padding tokens + row 0's first 9 tokens, positions counted from its first
    real token: its real tokens get row 0's logits, whatever the padding ids are."""
    padded = tokens.at[1].set(jnp.concatenate([jnp.full(3, 5), tokens[0, :9]]))
    mask = jnp.stack([jnp.ones(12, bool), jnp.arange(12) >= 3])
    positions = jnp.stack([jnp.arange(12), jnp.maximum(jnp.arange(12) - 3, 0)])
    out = fwd(TINY, params, padded, positions_BxT=positions, attention_mask_BxT=mask)
    np.testing.assert_allclose(out.logits[1, 3:], out.logits[0, :9], atol=1e-5)
    out2 = fwd(TINY, params, padded.at[1, :3].set(77), positions_BxT=positions,
               attention_mask_BxT=mask)
    np.testing.assert_allclose(out2.logits[1, 3:], out.logits[0, :9], atol=1e-5)
    np.testing.assert_array_equal(out2.logits[0], out.logits[0])


def test_gqa_equals_mha_with_repeated_kv_heads(params, tokens, fwd):
    """A GQA model (K=2) equals the MHA model (K=H=4) whose k/v kernels repeat each kv head
    for its H/K = 2 query heads."""
    gqa = params
    mha_cfg = TINY.replace(n_kv_heads=4)
    mha = jax.tree_util.tree_map(lambda x: x, gqa)
    for i in range(2):
        for name in ("k_proj", "v_proj"):
            k = gqa[f"layers_{i}"]["attn"][name]["kernel"].reshape(64, 2, 16)
            mha[f"layers_{i}"]["attn"][name] = {
                "kernel": jnp.repeat(k, 2, axis=1).reshape(64, 64)}
    np.testing.assert_allclose(fwd(mha_cfg, mha, tokens).logits,
                               fwd(TINY, gqa, tokens).logits, atol=1e-5)


def test_return_hidden_and_lm_head_kernel(params, tokens, fwd):
    out = fwd(TINY, params, tokens, return_hidden=True, return_logits=False)
    assert out.logits is None and out.hidden.shape == (2, 12, 64)
    logits = fwd(TINY, params, tokens).logits
    np.testing.assert_allclose(out.hidden @ lm_head_kernel(TINY, params), logits, atol=1e-5)


VARIANT = TINY.replace(moe_every=2, shared_expert_d_ff=24, tie_embeddings=True,
                       qkv_bias=True, qk_norm=False)


def test_variant_forward(tokens, fwd, random_params):
    """Dense MLP in layer 0 and MoE in layer 1 (moe_every=2), a shared expert, q/k/v biases,
    no q/k norm, tied embeddings: the LM head is the embedding transposed."""
    p = random_params(VARIANT)
    out = fwd(VARIANT, p, tokens, return_hidden=True)
    assert out.routed_experts.shape == (2, 12, 1, 2) and len(out.router_logits) == 1
    np.testing.assert_allclose(lm_head_kernel(VARIANT, p), p["embed"]["embedding"].T)
    np.testing.assert_allclose(out.logits, out.hidden @ p["embed"]["embedding"].T, atol=1e-5)
    # The shared expert is on the path: zeroing its gate projection changes the output;
    # zeroing its down projection instead gives the same change (both remove it entirely).
    def without(name):
        q = jax.tree_util.tree_map(lambda x: x, p)
        q["layers_1"]["moe"]["shared_expert"][name]["kernel"] *= 0.0
        return fwd(VARIANT, q, tokens, return_hidden=True).logits

    no_gate, no_down = without("gate_proj"), without("down_proj")
    assert np.abs(no_down - out.logits).max() > 1e-4
    np.testing.assert_allclose(no_gate, no_down, atol=1e-6)


def test_dense_model_has_no_routing(tokens, fwd, random_params):
    cfg = TINY.replace(moe_every=0)
    out = fwd(cfg, random_params(cfg), tokens)
    assert out.routed_experts.shape == (2, 12, 0, 2) and out.router_logits == ()
    assert out.aux_loss == 0.0 and np.isfinite(out.logits).all()


# ---- router and dispatch ------------------------------------------------------------------------
@pytest.mark.parametrize("norm", [True, False])
def test_select_experts_by_hand(norm):
    # probs = softmax(log([1, 2, 3, 4])) = [.1, .2, .3, .4]; top-2 = experts 3, 2 with .4, .3;
    # renormalised: 4/7, 3/7.
    logits = jnp.log(jnp.array([[1.0, 2.0, 3.0, 4.0]]))
    idx, w = router.select_experts(logits, 2, norm)
    np.testing.assert_array_equal(idx, [[3, 2]])
    np.testing.assert_allclose(w, [[4 / 7, 3 / 7]] if norm else [[0.4, 0.3]], rtol=1e-6)


def test_aux_losses_by_hand():
    # Uniform router (all logits 0) and each expert chosen by the same number of tokens:
    # f_e = k/E, p_e = 1/E, loss = E * E * (k/E) * (1/E) = k = 2.
    logits = jnp.zeros((8, 8))
    idx = jnp.array([[i, (i + 1) % 8] for i in range(8)])
    np.testing.assert_allclose(router.load_balance_loss(logits, idx), 2.0, rtol=1e-6)
    # All tokens to experts 0 and 1 with a uniform router: f = [1, 1, 0...], p = 1/8:
    # loss = 8 * (1/8 + 1/8) = 2 (the probability term is what the gradient pushes).
    idx01 = jnp.tile(jnp.array([[0, 1]]), (8, 1))
    np.testing.assert_allclose(router.load_balance_loss(logits, idx01), 2.0, rtol=1e-6)
    # Skewed probs: logits ln(7) on expert 0 -> p0 = 7/14 = .5, others 1/14; f = [1, 1, 0..]:
    # loss = 8 * (.5 + 1/14) = 4.5714...
    skew = jnp.zeros((8, 8)).at[:, 0].set(math.log(7.0))
    np.testing.assert_allclose(router.load_balance_loss(skew, idx01), 8 * (0.5 + 1 / 14), rtol=1e-5)
    # z-loss: logsumexp(0 * 8) = ln 8; masked tokens do not count.
    np.testing.assert_allclose(router.z_loss(logits), math.log(8.0) ** 2, rtol=1e-6)
    big = logits.at[4:].set(100.0)
    np.testing.assert_allclose(router.z_loss(big, jnp.arange(8) < 4), math.log(8.0) ** 2, rtol=1e-6)


@pytest.fixture(scope="module")
def moe_inputs():
    """37 tokens (not a multiple of anything), D=16, E=6 experts of F=8, top-3."""
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(k1, (37, 16))
    w = [jax.random.normal(k, s) * 0.1 for k, s in
         zip(jax.random.split(k2, 3), [(6, 16, 8), (6, 16, 8), (6, 8, 16)], strict=True)]
    idx, gates = router.select_experts(jax.random.normal(k3, (37, 6)), 3, True)
    return x, idx, gates, w


def test_exact_dispatches_agree(moe_inputs, jit):
    """Dropless (blocks of 1, 8, 64 rows), ragged_dot, and capacity with room for every
    assignment all equal every-expert-on-every-token weighted by the sparse gates."""

    def all_dispatches(x, idx, gates, w):
        out = {f"dropless{b}": dropless_dispatch(x, idx, gates, *w, block=b)
               for b in (1, 8, 64)}
        out |= {f"dropless_loop{b}": dropless_dispatch(x, idx, gates, *w, block=b, loop=True)
                for b in (1, 8)}
        out["ragged"] = ragged_dispatch(x, idx, gates, *w)
        # capacity factor E = 6: C = ceil(111/6 * 6) = 111 = every assignment fits
        out["capacity"], out["dropped"] = capacity_dispatch(x, idx, gates, *w, 6.0)
        out["dense"] = dense_dispatch(x, idx, gates, *w)
        return out

    x, idx, gates, w = moe_inputs
    out = jit(all_dispatches)(x, idx, gates, w)
    ref = out.pop("dense")
    # sanity of the reference: token 0 by hand, sum_j gate_j * SwiGLU_{e_j}(x_0)
    by_hand = sum(
        gates[0, j] * expert_ffn(x[None, :1], *(wi[idx[0, j]][None] for wi in w))[0, 0]
        for j in range(3))
    np.testing.assert_allclose(ref[0], by_hand, atol=1e-6)
    assert out.pop("dropped") == 0.0
    for name, y in out.items():
        np.testing.assert_allclose(y, ref, atol=1e-5, err_msg=name)


def test_looped_dropless_gradients_equal_the_gathered(moe_inputs):
    """The looped layout (the engine's) differentiates to the gathered one's gradients."""
    x, idx, gates, w = moe_inputs

    def loss(loop, x, gates, w):
        return jnp.sum(jnp.sin(dropless_dispatch(x, idx, gates, *w, block=8, loop=loop)))

    grads = [jax.jit(jax.grad(functools.partial(loss, loop), argnums=(0, 1, 2)))(x, gates, w)
             for loop in (False, True)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_looped_dropless_gradients_with_idle_experts_and_long_groups(moe_inputs):
    """All 37 tokens routed to experts 0-2 of 6 (experts 3-5 idle, each busy expert 37 rows:
    several windows of 8 and of 16, the last one partly the next expert's): the hand-written
    backward gives the gathered layout's gradients, zero for the idle experts' weights."""
    x, _, gates, w = moe_inputs
    idx = jnp.tile(jnp.array([[2, 0, 1]], jnp.int32), (37, 1))

    def loss(loop, block, x, gates, w):
        y = dropless_dispatch(x, idx, gates, *w, block=block, loop=loop)
        return jnp.sum(jnp.sin(y))

    want = jax.jit(jax.grad(functools.partial(loss, False, 8), argnums=(0, 1, 2)))(x, gates, w)
    for window in (8, 16):
        got = jax.jit(jax.grad(functools.partial(loss, True, window), argnums=(0, 1, 2)))(
            x, gates, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        assert all(float(jnp.max(jnp.abs(g[3:]))) == 0.0 for g in got[2])


def test_looped_dropless_forward_is_the_gathered_bit_for_bit(moe_inputs):
    """`ModelConfig.forward_only` swaps the gathered dropless layout for the looped one in
    passes without a gradient: the outputs must not change at all, only the weight copies."""
    x, idx, gates, w = moe_inputs
    for block in (1, 8):
        gathered = jax.jit(lambda x, g, w, b=block: dropless_dispatch(x, idx, g, *w, block=b))
        looped = jax.jit(lambda x, g, w, b=block: dropless_dispatch(x, idx, g, *w, block=b,
                                                                    loop=True))
        np.testing.assert_array_equal(looped(x, gates, w), gathered(x, gates, w))
    assert get_preset("tiny").forward_only().dispatch == "dropless_loop"
    capacity = get_preset("tiny", dispatch="capacity")
    assert capacity.forward_only() == capacity  # dropping tokens is part of what it computes


def test_small_batch_dispatch_is_the_looped_one(moe_inputs):
    """The looped dispatch's batched first block (every expert's first `block` rows in one
    [E, block] product; decode steps), with and without rows past it (looped over the
    experts that have such rows): the same forward bit for bit as the plain loop, the
    gathered layout's gradients, zero for experts without rows."""
    x, idx, gates, w = moe_inputs
    counts = np.bincount(np.asarray(idx).ravel(), minlength=6)
    assert 16 < counts.max() <= 32  # first_block 32: all rows in it; 16: some past it

    def loss(first_block, x, gates, w):
        return jnp.sum(jnp.sin(looped_dispatch(x, idx, gates, *w, first_block=first_block)))

    plain = jax.jit(lambda x, g, w: looped_dispatch(x, idx, g, *w, first_block=0))(
        x, gates, w)
    want = jax.jit(jax.grad(lambda x, g, w: jnp.sum(jnp.sin(dropless_dispatch(
        x, idx, g, *w, block=8))), argnums=(0, 1, 2)))(x, gates, w)
    for block in (32, 16):
        out = jax.jit(lambda x, g, w, b=block: looped_dispatch(x, idx, g, *w, first_block=b))
        np.testing.assert_array_equal(out(x, gates, w), plain)
        got = jax.jit(jax.grad(functools.partial(loss, block), argnums=(0, 1, 2)))(x, gates, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    # experts 3-5 without rows: their idle blocks, and the loop over the rows past the
    # blocks that skips them, leave their weight gradients exactly zero
    idle = jnp.tile(jnp.array([[2, 0, 1]], jnp.int32), (5, 1))
    for block in (8, 4):  # 5 rows each: all in the block, then one past it
        grads = jax.grad(lambda w, b=block: jnp.sum(jnp.sin(looped_dispatch(
            x[:5], idle, gates[:5], *w, first_block=b))))(w)
        assert all(float(jnp.max(jnp.abs(g[3:]))) == 0.0 for g in grads)
        assert all(float(jnp.max(jnp.abs(g[:3]))) > 0.0 for g in grads)


def test_small_batch_block_follows_the_mean_load():
    """Twice an expert's mean load, a power of two >= 4, up to 16 rows; none above."""
    sizes = {(a, e): first_block_size(a, e) for a, e in
             [(64, 8), (40, 8), (32, 8), (16, 8), (72, 8), (128, 8), (111, 6), (256, 128)]}
    assert sizes == {(64, 8): 16, (40, 8): 16, (32, 8): 8, (16, 8): 4, (72, 8): 0,
                     (128, 8): 0, (111, 6): 0, (256, 128): 4}


def test_capacity_dispatch_drops_excess_in_token_order(moe_inputs, jit):
    """All 37 tokens to experts (0, 1, 2): A = 111, C = ceil(111/6 * 1.0) = 19 per expert, so
    tokens 0..18 keep all three experts, tokens 19..36 lose all: dropped = 54/111."""
    x, _, gates, w = moe_inputs
    idx = jnp.broadcast_to(jnp.array([0, 1, 2]), (37, 3))
    dispatch = jit(capacity_dispatch, static_argnums=6)
    out, dropped = dispatch(x, idx, gates, *w, 1.0)
    ref = dense_dispatch(x, idx, gates, *w)
    np.testing.assert_allclose(dropped, 54 / 111, rtol=1e-6)
    np.testing.assert_allclose(out[:19], ref[:19], atol=1e-5)
    np.testing.assert_array_equal(out[19:], 0.0)
    # Tokens 0..9 are padding: real tokens take the capacity first, so tokens 10..28 are kept
    # and 29..36 dropped: 8 of the 27 real tokens, dropped = 8*3 / (27*3) = 8/27.
    valid = jnp.arange(37) >= 10
    out, dropped = dispatch(x, idx, gates, *w, 1.0, valid)
    np.testing.assert_allclose(dropped, 8 / 27, rtol=1e-6)
    np.testing.assert_allclose(out[10:29], ref[10:29], atol=1e-5)
    np.testing.assert_array_equal(out[29:], 0.0)
    np.testing.assert_array_equal(out[:10], 0.0)


def test_capacity_drops_are_counted(params, tokens, fwd):
    """All 24 tokens replayed to experts (0, 1): A = 48 assignments, C = ceil(48/8 * 1.0) = 6
    per expert, so 12 are kept and 36/48 = 0.75 dropped in each layer."""
    cfg = TINY.replace(dispatch="capacity", capacity_factor=1.0)
    replay = jnp.broadcast_to(jnp.array([0, 1]), (2, 12, 2, 2))
    out = fwd(cfg, params, tokens, routed_experts_BxTxMxk=replay)
    np.testing.assert_allclose(out.metrics["moe/dropped_frac"], 0.75)


def test_config_is_hashable_and_static():
    assert hash(TINY) == hash(get_preset("tiny"))
    assert isinstance(TINY.replace(top_k=1), ModelConfig)


def test_remat_gives_the_same_gradients(params, tokens, jit):
    def loss(p, cfg):
        out = forward(cfg, p, tokens)
        return jnp.mean(jax.nn.logsumexp(out.logits, -1)) + out.aux_loss

    grad = jit(jax.grad(loss), static_argnums=1)
    remat = TINY.replace(remat=True)
    assert grad.lower(params, remat).as_text().count("optimization_barrier") >= 2  # 1 per block
    for a, b in zip(jax.tree_util.tree_leaves(grad(params, TINY)),
                    jax.tree_util.tree_leaves(grad(params, remat)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7)


# ---- attention in causal blocks ---------------------------------------------------------------
ONE_BLOCK = TINY  # the preset's: attention in one block


def _packed_rows():
    """Two rows of 12 tokens: three packed sequences (positions restart per segment, a padded
    tail) and one left-padded sequence, the layouts the learner builds."""
    segments = jnp.array([[1] * 4 + [2] * 5 + [3] * 2 + [0], [0] * 3 + [1] * 9])
    positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 0], [0, 0, 0, *range(9)]])
    return segments, positions


def test_softmax_attention_backward_equals_autodiff_of_the_plain_formula(jit):
    """The hand-written attention backward against jax.grad of softmax(masked q.k / sqrt(A)) v
    written out, on the learner's layouts (three sequences packed in a row, a padded tail; a
    left-padded row): padding queries see no key and get a uniform distribution in both."""
    segments, positions = _packed_rows()
    b, t, kv, g, a = segments.shape[0], segments.shape[1], 2, 3, 8
    kq, kk, kv_, kw = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(kq, (b, kv, g * t, a))
    k, v = jax.random.normal(kk, (b, kv, t, a)), jax.random.normal(kv_, (b, kv, t, a))
    w = jax.random.normal(kw, (b, kv, g * t, a))
    mask = ((positions[:, None, :] <= positions[:, :, None]) & (segments[:, None, :] > 0)
            & (segments[:, None, :] == segments[:, :, None]))[:, None, None]

    def plain(q, k, v):
        s = jnp.einsum("bkqa,bksa->bkqs", q, k).reshape(b, kv, g, t, t) / math.sqrt(a)
        p = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min), axis=-1)
        return jnp.einsum("bkqs,bksa->bkqa", p.reshape(b, kv, g * t, t), v)

    hand = lambda q, k, v: attention.softmax_attention(q, k, v, mask, g, jnp.float32)
    np.testing.assert_allclose(jit(hand)(q, k, v), jit(plain)(q, k, v), atol=1e-5)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
    want = jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(q, k, v)
    got = jit(jax.grad(loss(hand), argnums=(0, 1, 2)))(q, k, v)
    for name, x, y in zip("qkv", got, want, strict=True):
        assert float(jnp.max(jnp.abs(y))) > 0.1, name  # every input has a gradient
        np.testing.assert_allclose(x, y, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("blocks", [3, 4, 5])  # 12 tokens: blocks of 4, 3, and 3 x 3 + 0
def test_causal_blocks_give_the_full_attention(params, tokens, jit, blocks):
    """Query blocks that read only the keys up to their own end: logits, routing and gradients
    as with one block (the keys left out are always masked), on packed and padded rows."""
    segments, positions = _packed_rows()

    def out(p, cfg):
        o = forward(cfg, p, tokens, positions_BxT=positions, segment_ids_BxT=segments)
        return o.logits, o.routed_experts

    def loss(p, cfg):
        logits = out(p, cfg)[0]
        return jnp.sum(jax.nn.logsumexp(logits, -1) * (segments > 0)) / jnp.sum(segments > 0)

    cfg = TINY.replace(causal_blocks=blocks)
    (full, routed), (part, routed_part) = jit(out, static_argnums=1)(params, ONE_BLOCK), jit(
        out, static_argnums=1)(params, cfg)
    valid = np.asarray(segments > 0)
    np.testing.assert_allclose(np.asarray(part)[valid], np.asarray(full)[valid], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(routed_part)[valid], np.asarray(routed)[valid])
    grad = jit(jax.grad(loss), static_argnums=1)
    for a, b in zip(jax.tree_util.tree_leaves(grad(params, ONE_BLOCK)),
                    jax.tree_util.tree_leaves(grad(params, cfg)), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)


def test_causal_blocks_are_checked_and_leave_the_cache_path_alone(params, tokens, fwd):
    with pytest.raises(ValueError, match="causal_blocks must be >= 1"):
        TINY.replace(causal_blocks=0)
    cache, empty = init_cache(TINY, 2, 16), jnp.zeros((2, 16), bool)
    with_cache = fwd(TINY.replace(causal_blocks=4), params, tokens, cache=cache,
                     cache_mask_BxS=empty)
    one_block = fwd(ONE_BLOCK, params, tokens, cache=cache, cache_mask_BxS=empty)
    np.testing.assert_array_equal(with_cache.logits, one_block.logits)  # a prefill: one block


# ---- chunked attention ------------------------------------------------------------------------
CHUNKED = TINY.replace(attention_chunk=5)  # 12 tokens: chunks of 5, 5 and 2 (+3 padding rows)


def test_chunked_attention_gives_the_same_logits(params, tokens, fwd):
    """Left padding and per-row positions as in test_left_padding_with_attention_mask."""
    mask = jnp.stack([jnp.ones(12, bool), jnp.arange(12) >= 3])
    positions = jnp.stack([jnp.arange(12), jnp.maximum(jnp.arange(12) - 3, 0)])
    full = fwd(ONE_BLOCK, params, tokens, positions_BxT=positions, attention_mask_BxT=mask)
    part = fwd(CHUNKED, params, tokens, positions_BxT=positions, attention_mask_BxT=mask)
    np.testing.assert_allclose(part.logits[0], full.logits[0], atol=1e-5)
    np.testing.assert_allclose(part.logits[1, 3:], full.logits[1, 3:], atol=1e-5)
    np.testing.assert_array_equal(part.routed_experts, full.routed_experts)


def test_chunked_attention_prefills_the_same_cache(params, tokens, fwd):
    cache, empty = init_cache(TINY, 2, 16), jnp.zeros((2, 16), bool)
    full = fwd(TINY, params, tokens, cache=cache, cache_mask_BxS=empty)
    part = fwd(CHUNKED, params, tokens, cache=cache, cache_mask_BxS=empty)
    np.testing.assert_allclose(part.logits, full.logits, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(full.cache), jax.tree_util.tree_leaves(part.cache),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_chunked_attention_gives_the_same_gradients(params, tokens, jit):
    def loss(p, cfg):
        out = forward(cfg, p, tokens)
        return jnp.mean(jax.nn.logsumexp(out.logits, -1)) + out.aux_loss

    grad = jit(jax.grad(loss), static_argnums=1)
    for a, b in zip(jax.tree_util.tree_leaves(grad(params, ONE_BLOCK)),
                    jax.tree_util.tree_leaves(grad(params, CHUNKED)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_chunked_attention_holds_one_chunk_of_scores(jit):
    """Gradient of a 1-layer model at T = 512 (4 heads): unchunked, the backward needs the
    [B, H, T, T] fp32 exponentiated scores (4 MiB per sequence; `softmax_attention` keeps no
    probabilities besides them); in chunks of 64 only the chunk being recomputed (1/8 of them)
    is alive at once, so XLA's temporary memory falls by at least 7/8 of 4 MiB (measured:
    11.5 MB -> 4.9 MB)."""
    cfg = TINY.replace(n_layers=1, max_seq_len=512)
    p = jax.eval_shape(lambda r: init_params(cfg, r), jax.random.key(0))
    toks = jax.ShapeDtypeStruct((1, 512), jnp.int32)

    def temp_bytes(c):
        def loss(p, t):
            return jnp.mean(forward(c, p, t).logits)
        compiled = jit(jax.grad(loss)).lower(p, toks).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    scores = 4 * 512 * 512 * 4
    full, part = temp_bytes(cfg), temp_bytes(cfg.replace(attention_chunk=64))
    assert full >= scores
    assert full - part >= scores * 7 // 8, (full, part)
