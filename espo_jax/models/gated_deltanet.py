"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), as transformers'
`Qwen3NextGatedDeltaNet` with its torch `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule`.

Per token (Hk key heads of dim Dk, Hv value heads of dim Dv, Hv a multiple of Hk):
- q, k [Hk * Dk] and v [Hv * Dv] projections, each through a causal depthwise conv of width W
  (`linear_conv_kernel`) and SiLU; q and k L2-normalised per head (eps 1e-6 inside the rsqrt),
  q scaled by Dk^-1/2; key head j serves value heads j * Hv/Hk ... (j + 1) * Hv/Hk - 1.
- per value head a decay g = -exp(A_log) * softplus(a + dt_bias) <= 0 and a write strength
  beta = sigmoid(b), from the a and b projections [Hv].
- the gated delta rule over a state S [Dk, Dv] per value head:
    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t.
- o is RMS-normalised per head (a weight [Dv], not zero-centred), times silu(z) from the z
  projection [Hv * Dv], then out_proj.

Two forms of the rule, equal up to float summation order: `chunk_gated_delta_rule` (whole
sequences: the learner and prefill; within a chunk of C tokens the delta updates are one
unit-lower-triangular solve, chunks follow in a `lax.scan`) and `recurrent_step` (one token:
decoding). Packed rows (several sequences in one row, `segment_ids`) restart the state at
every segment boundary: the decay between tokens of different segments is zero, applied as a
mask, so a boundary anywhere in a chunk is exact. A shared prefix's members
(`attention.PREFIX_STRIDE` segment ids: a prompt once, then each response) start from the state
after the prefix instead (`history`), and their conv reads the prefix's last inputs; the conv
otherwise reads only its own segment's inputs.

Cache (`cache_shapes`), per slot and layer: the last W - 1 conv inputs of q, k, v and the state
[Hv, Dk, Dv] in float32: (W - 1) (2 Hk Dk + Hv Dv) numbers in the cache dtype plus 4 Hv Dk Dv
bytes, whatever the sequence length (Qwen3-Next-80B in bf16: 3 * 8192 * 2 + 32 * 128 * 128 * 4
= 2.10 MB per linear layer). A cached forward expects the valid tokens of each row first
(right padding, as the engine's prefill and decode give); invalid tokens leave the cache as is.

Logical axes: q/k projections and convs "kv_heads" (the Hk key heads), v/z/a/b projections,
convs, A_log and dt_bias "heads" (the Hv value heads), out_proj ("heads", "embed").
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from espo_jax.models.attention import PREFIX_STRIDE
from espo_jax.models.config import ModelConfig
from espo_jax.models.layers import dense, weight

L2_EPS = 1e-6  # transformers / FLA l2norm: x * rsqrt(sum(x^2) + eps)


# a layer's cache has no slot axis: its conv windows and state are of a fixed size (`cache_shapes`)
CACHE_SLOT_AXES = {"conv_q": None, "conv_k": None, "conv_v": None, "state": None}


def cache_shapes(config: ModelConfig, batch: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{name: (shape, dtype or None for the cache dtype)} of one linear layer's cache."""
    c, w = config, config.linear_conv_kernel - 1
    qk, v = c.linear_n_key_heads * c.linear_key_head_dim, (
        c.linear_n_value_heads * c.linear_value_head_dim)
    return {"conv_q": ((batch, w, qk), None), "conv_k": ((batch, w, qk), None),
            "conv_v": ((batch, w, v), None),
            "state": ((batch, c.linear_n_value_heads, c.linear_key_head_dim,
                       c.linear_value_head_dim), jnp.float32)}


def l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def causal_conv(x_BxTxC: jax.Array, kernel_WxC: jax.Array, segments_BxT: jax.Array,
                window_BxWxC: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(silu(depthwise causal conv), the last W - 1 inputs): out_t = sum_w kernel[w] * the
    input W-1-w steps back along t's history (its segment, then for a shared prefix's member
    the prefix's last inputs; zeros before). `window_BxWxC` holds the W - 1 inputs before x (a
    cache, one sequence per row: they count as x's first segment); the new window is the W - 1
    inputs before the first token whose segment id is 0 (right padding), or the last ones."""
    b, t, ch = x_BxTxC.shape
    w = kernel_WxC.shape[0]
    out = jnp.zeros((b, t, ch), jnp.float32)
    if window_BxWxC is None:
        hist = history(segments_BxT)
        idx = jnp.arange(t, dtype=jnp.int32)[None]
        prefix_start = jnp.take_along_axis(hist["start"], jnp.maximum(hist["prefix_end"], 0),
                                           axis=1)
        for r in range(w):  # r steps back
            src = idx - r
            beyond = r - (idx - hist["start"])  # steps past the segment's start (>= 1: out)
            src = jnp.where(beyond >= 1, hist["prefix_end"] - beyond + 1, src)
            ok = (beyond < 1) | (hist["member"] & (src >= prefix_start))
            xr = jnp.take_along_axis(x_BxTxC, jnp.maximum(src, 0)[:, :, None], axis=1)
            out += jnp.where(ok[:, :, None], xr, 0).astype(jnp.float32) * kernel_WxC[
                w - 1 - r].astype(jnp.float32)
        return jax.nn.silu(out).astype(x_BxTxC.dtype), jnp.zeros((b, w - 1, ch), x_BxTxC.dtype)
    window_seg = jnp.broadcast_to(segments_BxT[:, :1], (b, w - 1))
    full = jnp.concatenate([window_BxWxC.astype(x_BxTxC.dtype), x_BxTxC], axis=1)
    seg = jnp.concatenate([window_seg, segments_BxT], axis=1)
    for i in range(w):
        same = (seg[:, i:i + t] == segments_BxT)[:, :, None]
        out += jnp.where(same, full[:, i:i + t], 0).astype(jnp.float32) * kernel_WxC[i].astype(
            jnp.float32)
    n_valid = jnp.sum(segments_BxT > 0, axis=1)  # valid tokens come first (a cache's rows)
    idx = n_valid[:, None] + jnp.arange(w - 1)[None]
    new_window = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return jax.nn.silu(out).astype(x_BxTxC.dtype), new_window


def history(segments_BxT: jax.Array) -> dict[str, jax.Array]:
    """Where each token's history starts ([B, T] int32 / bool): `start`, the first index of its
    segment; `member`, a continuation of a shared prefix (`attention.PREFIX_STRIDE` ids g * S + m,
    m >= 1); `prefix_end`, for members the last index of their group's prefix (segment id
    g * S) before `start`, else -1; `prefix_id` (g * S)."""
    b, t = segments_BxT.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    prev = jnp.concatenate([segments_BxT[:, :1], segments_BxT[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where((segments_BxT != prev) | (idx == 0), idx, 0), axis=1)
    prefix_id = segments_BxT - segments_BxT % PREFIX_STRIDE
    is_prefix = (segments_BxT >= PREFIX_STRIDE) & (segments_BxT % PREFIX_STRIDE == 0)
    member = (segments_BxT >= PREFIX_STRIDE) & ~is_prefix
    last_prefix = jax.lax.cummax(jnp.where(is_prefix, idx, -1), axis=1)
    e = jnp.take_along_axis(last_prefix, start, axis=1)
    found = jnp.take_along_axis(segments_BxT, jnp.maximum(e, 0), axis=1) == prefix_id
    prefix_end = jnp.where(member & (e >= 0) & found, e, -1)
    return {"start": start, "member": member & (prefix_end >= 0), "prefix_end": prefix_end,
            "prefix_id": prefix_id, "is_prefix": is_prefix}


def chunk_gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, segments_BxT,
                           chunk: int, state_BxHxKxV=None):
    """(o [B, T, H, V], final state [B, H, K, V]) of the gated delta rule, C = `chunk` tokens
    at a time. q (already scaled) and k are per value head. A token's history is its own
    segment, plus, for a member of a shared prefix's group (`attention.PREFIX_STRIDE`), that
    prefix: a segment starts from a zero state, a member from the state after its prefix (the
    packed layout: a prefix, then its members). `state_BxHxKxV` is the state before the first
    token (zero if None), the first segment's. All in float32.

    Within a chunk, relative to the state S0 before it (h_i: the decay's log summed along i's
    history from the chunk start, or from its segment's start when that is inside the chunk;
    G_ij = exp(h_i - h_j) for j <= i in i's history, else 0; c_i = 1 if i's history continues
    S0): the corrections d (the written values beta (v - S^T k)) solve (I + L) d = beta v -
    beta c exp(h) k S0 with L_ij = beta_i k_i.k_j G_ij (j < i), and o_i = c_i exp(h_i) q_i S0 +
    sum_{j<=i} q_i.k_j G_ij d_j. A member starting in the chunk whose prefix ended before it
    reads the prefix's final state (carried beside S0) the same way; the state after a token
    e is c_e exp(h_e) S0 + sum_j G_ej k_j d_j, taken at the chunk's end and its prefix end."""
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH,
                                                 beta_BxTxH))
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    n = -(-t // chunk)
    pad = n * chunk - t
    # padding continues the last segment with g = 0, beta = 0: the state passes through it
    seg = jnp.pad(segments_BxT, ((0, 0), (0, pad)), mode="edge")
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    hist = history(seg)

    def chunks(x):  # [B, N*C, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(b, n, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1) if x.ndim > 3 else x
    q, k, v = (chunks(x) for x in (q, k, v))
    g, beta = (jnp.moveaxis(x.reshape(b, n, chunk, h), 3, 1) for x in (g, beta))
    seg_c, start, member, prefix_end, prefix_id = (
        hist[name].reshape(b, n, chunk) if name != "seg" else seg.reshape(b, n, chunk)
        for name in ("seg", "start", "member", "prefix_end", "prefix_id"))
    base = (jnp.arange(n, dtype=jnp.int32) * chunk)[None, :, None]  # chunk start
    s_loc, e_loc = start - base, prefix_end - base  # [B, N, C]
    prev = jnp.concatenate([seg[:, :1], seg[:, chunk - 1:-1:chunk]], axis=1)[:, :, None]
    src_cur = (seg_c == prev) | (member & (prefix_id == prev))
    src_pref = member & (s_loc >= 0) & (e_loc < -1) & ~src_cur  # prefix ended earlier
    # a prefix's last token: where the prefix segment ends (the next token is another segment)
    nxt = jnp.concatenate([seg[:, 1:], jnp.full((b, 1), -1, seg.dtype)], axis=1)
    ends_prefix = (hist["is_prefix"] & (seg != nxt)).reshape(b, n, chunk)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    vis = causal & ((seg_c[:, :, :, None] == seg_c[:, :, None, :]) | (
        member[:, :, :, None] & (seg_c[:, :, None, :] == prefix_id[:, :, :, None])))

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    cum0 = jnp.pad(cum, ((0, 0), (0, 0), (0, 0), (1, 0)))  # cum0[m]: the first m tokens' sum

    def at(x, idx):  # x [B, H, N, C(+1)] at chunk-local indices idx [B, N, C]
        return jnp.take_along_axis(x, jnp.broadcast_to(idx[:, None], (b, h, n, chunk)), axis=3)

    h_seg = cum - at(cum0, jnp.maximum(s_loc, 0))  # from the segment's start in the chunk
    joins = member & (s_loc >= 0) & (e_loc >= 0)  # starts here after its prefix, also here
    hc = h_seg + jnp.where(joins[:, None], at(h_seg, jnp.maximum(e_loc, 0)), 0)
    diff = jnp.where(vis[:, None], hc[..., :, None] - hc[..., None, :], -jnp.inf)
    gamma = jnp.exp(diff)  # G_ij [B, H, N, C, C]
    exp_hc = jnp.exp(jnp.where((src_cur | src_pref)[:, None], hc, -jnp.inf))
    in_cur = exp_hc * src_cur[:, None]
    in_pref = exp_hc * src_pref[:, None]
    kb = k * beta[..., None]
    lower = jnp.einsum("bhnik,bhnjk->bhnij", kb, k) * gamma * (1 - jnp.eye(chunk, dtype=f32))
    system = lower + jnp.eye(chunk, dtype=f32)
    solve = lambda rhs: jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True,
                                                        unit_diagonal=True)
    u = solve(v * beta[..., None])  # [B, H, N, C, V]
    w_cur, w_pref = solve(kb * in_cur[..., None]), solve(kb * in_pref[..., None])
    qk = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * gamma
    q_cur, q_pref = q * in_cur[..., None], q * in_pref[..., None]
    # the state after the chunk's last token (L) and after its last prefix end (E, if any)
    sel_end = jnp.zeros((b, n, chunk), bool).at[:, :, -1].set(True)
    last_e = jnp.max(jnp.where(ends_prefix, jnp.arange(chunk), -1), axis=-1)  # [B, N]
    sel_pref = jnp.arange(chunk)[None, None] == last_e[..., None]
    has_pref = last_e >= 0

    def state_at(sel):  # (G row of the selected token, its c*exp(h) from S0 / S_pref)
        row = jnp.sum(gamma * sel[:, None, :, :, None], axis=3)  # [B, H, N, C]
        return (row, jnp.sum(in_cur * sel[:, None], -1), jnp.sum(in_pref * sel[:, None], -1))
    end_row, end_cur, end_pref = state_at(sel_end)
    pe_row, pe_cur, pe_pref = state_at(sel_pref)
    k_end, k_pe = k * end_row[..., None], k * pe_row[..., None]

    def step(carry, xs):
        s_cur, s_pref = carry
        u_i, wc, wp, qk_i, qc, qp, ke, ec, ep, kp, pc, pp, has = xs
        d = u_i - jnp.einsum("bhck,bhkv->bhcv", wc, s_cur) - jnp.einsum(
            "bhck,bhkv->bhcv", wp, s_pref)
        o = (jnp.einsum("bhck,bhkv->bhcv", qc, s_cur) + jnp.einsum("bhck,bhkv->bhcv", qp, s_pref)
             + jnp.einsum("bhij,bhjv->bhiv", qk_i, d))

        def after(kk, c, p):
            return (s_cur * c[..., None, None] + s_pref * p[..., None, None]
                    + jnp.einsum("bhck,bhcv->bhkv", kk, d))
        new_pref = jnp.where(has[:, None, None, None], after(kp, pc, pp), s_pref)
        return (after(ke, ec, ep), new_pref), o

    s0 = jnp.zeros((b, h, dk, dv), f32) if state_BxHxKxV is None else state_BxHxKxV.astype(f32)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w_cur, w_pref, qk, q_cur, q_pref, k_end,
                                               end_cur, end_pref, k_pe, pe_cur, pe_pref))
    xs += (jnp.moveaxis(has_pref, 1, 0),)
    (s_final, _), o = jax.lax.scan(step, (s0, jnp.zeros_like(s0)), xs)  # o [N, B, H, C, V]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.moveaxis(o, 1, 2), s_final


def recurrent_step(q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH, state_BxHxKxV):
    """One token of the gated delta rule: (o [B, H, V], new state); float32."""
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH))
    s = state_BxHxKxV.astype(f32) * jnp.exp(g)[..., None, None]
    delta = (v - jnp.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", s, q), s


def _conv_init(key, shape, dtype):
    """torch's Conv1d default for a depthwise kernel: uniform in +-1/sqrt(W)."""
    bound = shape[0] ** -0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _a_log_init(key, shape, dtype):
    """log(A), A uniform in [0.01, 16] (transformers' init)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16)).astype(dtype)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(z) over the last axis (transformers `RMSNormGated`): the
    statistics and gate in float32, the weight (initialised to 1) not zero-centred."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        scale = weight(self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",),
                       self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = jnp.asarray(scale, self.dtype) * y.astype(self.dtype)
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer (same arguments and cache contract as
    `gqa.Attention`; positions are unused: order within the row is the sequence)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        segments_BxT: jax.Array,
        cache: dict | None = None,
        cache_mask_BxS: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None]:
        del positions_BxT, cache_mask_BxS
        c = self.config
        b, t, _ = x_BxTxD.shape
        hk, dk, hv, dv = (c.linear_n_key_heads, c.linear_key_head_dim, c.linear_n_value_heads,
                          c.linear_value_head_dim)
        valid_BxT = segments_BxT > 0
        x_BxTxD = jnp.where(valid_BxT[:, :, None], x_BxTxD, 0)  # as HF's padding mask
        if cache is not None:  # one sequence per row; padding (after it) must not touch it
            segments_BxT = jnp.ones_like(segments_BxT)
        conv_segments = jnp.where(valid_BxT, 1, 0) if cache is not None else segments_BxT
        new_cache = {}
        mixed = {}
        for name, heads, dim, axis in (("q", hk, dk, "kv_heads"), ("k", hk, dk, "kv_heads"),
                                       ("v", hv, dv, "heads")):
            y = dense(c, heads * dim, ("embed", axis), f"{name}_proj")(x_BxTxD)
            kernel = weight(self, f"conv_{name}", _conv_init, (c.linear_conv_kernel, heads * dim),
                            (None, axis), c.param_dtype)
            window = None if cache is None else cache[f"conv_{name}"]
            y, new_window = causal_conv(y, jnp.asarray(kernel, c.dtype), conv_segments, window)
            if cache is not None:
                new_cache[f"conv_{name}"] = new_window.astype(window.dtype)
            mixed[name] = y.reshape(b, t, heads, dim).astype(jnp.float32)
        z = dense(c, hv * dv, ("embed", "heads"), "z_proj")(x_BxTxD).reshape(b, t, hv, dv)
        beta = jax.nn.sigmoid(dense(c, hv, ("embed", "heads"), "b_proj")(x_BxTxD).astype(
            jnp.float32))
        a = dense(c, hv, ("embed", "heads"), "a_proj")(x_BxTxD).astype(jnp.float32)
        a_log = weight(self, "A_log", _a_log_init, (hv,), ("heads",), c.param_dtype)
        dt_bias = weight(self, "dt_bias", nn.initializers.ones, (hv,), ("heads",), c.param_dtype)
        g = -jnp.exp(jnp.asarray(a_log, jnp.float32)) * jax.nn.softplus(
            a + jnp.asarray(dt_bias, jnp.float32))
        if cache is not None:  # invalid tokens: identity updates (decay 1, no write)
            g, beta = (jnp.where(valid_BxT[:, :, None], x, 0) for x in (g, beta))
        rep = hv // hk
        q = jnp.repeat(l2norm(mixed["q"]), rep, axis=2) * dk ** -0.5
        k = jnp.repeat(l2norm(mixed["k"]), rep, axis=2)
        state = None if cache is None else cache["state"]
        if cache is not None and t == 1:
            o, s = recurrent_step(q[:, 0], k[:, 0], mixed["v"][:, 0], g[:, 0], beta[:, 0], state)
            o = o[:, None]
        else:
            o, s = chunk_gated_delta_rule(q, k, mixed["v"], g, beta, segments_BxT,
                                          min(c.linear_chunk, max(t, 1)), state)
        if cache is not None:
            new_cache["state"] = s.astype(state.dtype)
        o = GatedRMSNorm(c.rms_eps, c.dtype, c.param_dtype, name="norm")(o.astype(c.dtype), z)
        out = dense(c, c.d_model, ("heads", "embed"), "o_proj")(o.reshape(b, t, hv * dv))
        return out, (new_cache if cache is not None else None)
