"""MoE dispatch: the routed tokens through their experts' SwiGLU and back, weighted by the
gates (`expert_ffn` the experts; `moe.MoeBlock` picks an implementation by name).

Every implementation takes the tokens x_NxD, the chosen experts idx_Nxk and their gate
weights weights_Nxk (`router`), and the expert weights wg_ExDxF, wu_ExDxF, wo_ExFxD.
Token-level arrays are flattened: N = B*T tokens, A = N*k (token, expert) assignments.

Dispatch implementations (`ModelConfig.dispatch`):
- "dropless_loop" (default): exact top-k, computed expert by expert. The assignments are
  sorted by expert; a loop over the experts reads each expert's weights once and runs its rows
  through them in windows of a few rows, as many windows as that expert has rows (a dynamic
  trip count, so no padding blocks are computed and no [blocks, D, F] weight copies made).
  Every token reaches exactly its top-k experts (as Hugging Face and vLLM compute it). Loops
  with dynamic trip counts have no reverse mode: the backward is the same loops written by
  hand (a custom VJP). The fastest exact dispatch measured on CPU (2-core Intel Xeon,
  2026-12-04, the GRPO peers model's layer: 8 experts of 256, top-2): forward 0.37 / 0.98 /
  3.35 ms at 64 / 256 / 1024 tokens (gathered: 1.03 / 2.16 / 5.64); forward + backward at
  4096 tokens 46 ms (gathered 56), the peers train step 310 ms (gathered 368). In small
  batches (an expert's mean load <= 8 rows: decode steps) each expert's first few rows
  (`first_block_size`) go through one batched product over the experts instead, the rest
  (a skewed load) through the loop over the experts that have them: the loop's per-expert
  weight copies and per-window ops cost more there than the idle rows' arithmetic (the same
  layer, 2-core AMD EPYC, 2026-12-04: 32 tokens with the routes of a decode of the peers
  model 0.28-0.31 ms against 0.36-0.38 ms looped; 16 uniformly routed tokens 0.13 against
  0.37 ms).
- "dropless": the same assignments, each expert's group padded to a multiple of a block of
  rows, one batched matmul over the blocks with each block's expert weights gathered: static
  shapes (A + E*(block-1) rows at most), plain autodiff; the same outputs bit for bit.
- "capacity": each expert takes at most C = ceil(A/E * capacity_factor) assignments, the rest
  are dropped (their contribution is zero) and counted in `moe/dropped_frac`.
- "ragged": `jax.lax.ragged_dot` grouped matmul (exact; fast on GPU/TPU, slow on CPU).
- "dense": every expert on every token, weighted by the sparse gates (exact; E/k times the
  compute; a reference).

Measured before the looped layout (2-core AMD EPYC; preset `small`: 16 experts top-2, 16 x 128
tokens, jitted fp32 AdamW train step, CPU-seconds per step, medians of variants run
round-robin): dropless 0.64, capacity 1.25 0.53 (drops tokens), capacity 2.0 0.63, dense 1.98,
ragged 2.64; a dense-MLP model with the same active FLOPs 0.45. Dropless block sizes (16
experts, d_expert 128): 16 rows 0.70, 32 0.55, 64 0.50, 128 0.52.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp


def expert_ffn(x_GxRxD: jax.Array, wg_GxDxF, wu_GxDxF, wo_GxFxD) -> jax.Array:
    """SwiGLU of G row groups, each with its own expert weights."""
    dt = x_GxRxD.dtype  # fp32 accumulation, rounded after (`layers.matmul`)
    prod = lambda eq, a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32).astype(dt)
    h = nn.silu(prod("grd,gdf->grf", x_GxRxD, wg_GxDxF)) * prod("grd,gdf->grf", x_GxRxD,
                                                                 wu_GxDxF)
    return prod("grf,gfd->grd", h, wo_GxFxD)


def _sort_by_expert(idx_A: jax.Array, n_experts: int, valid_A: jax.Array | None = None):
    """Stable sort of the assignments by expert (within an expert, valid assignments first
    when `valid_A` is given): (order_A, sorted expert, rank within its expert's group, count
    per expert)."""
    key_A = idx_A if valid_A is None else idx_A * 2 + (~valid_A).astype(idx_A.dtype)
    order_A = jnp.argsort(key_A, stable=True)
    sorted_e_A = idx_A[order_A]
    counts_E = jnp.zeros(n_experts, jnp.int32).at[idx_A].add(1)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_A = jnp.arange(idx_A.shape[0], dtype=jnp.int32) - starts_E[sorted_e_A]
    return order_A, sorted_e_A, rank_A, counts_E


def _combine(y_PxD, dest_A, weights_Nxk) -> jax.Array:
    """Gather each assignment's expert output (row P = zero when dropped) and sum over k."""
    n, k = weights_Nxk.shape
    y_pad = jnp.concatenate([y_PxD, jnp.zeros((1, y_PxD.shape[-1]), y_PxD.dtype)])
    y_NxkxD = y_pad[dest_A].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y_NxkxD, weights_Nxk.astype(y_PxD.dtype))


def _gather_rows(x_NxD, dest_A, k, n_rows) -> jax.Array:
    """[n_rows, D] buffer: row dest_A[a] holds x of assignment a's token; other rows zero."""
    n = x_NxD.shape[0]
    token_A = jnp.arange(dest_A.shape[0], dtype=jnp.int32) // k
    src = jnp.full((n_rows,), n, jnp.int32).at[dest_A].set(token_A, mode="drop")
    x_pad = jnp.concatenate([x_NxD, jnp.zeros((1, x_NxD.shape[-1]), x_NxD.dtype)])
    return x_pad[src]


def block_size(n_assignments: int, n_experts: int) -> int:
    """Rows per block of the dropless dispatch: ~ a quarter of an expert's mean load, a power of
    two in [8, 128] (padding waste is at most E*(block-1) rows)."""
    target = max(1, n_assignments // (4 * n_experts))
    return int(min(128, max(8, 2 ** round(math.log2(target)))))


def window_size(n_assignments: int, n_experts: int) -> int:
    """Rows per window of the looped dropless dispatch: ~ a quarter of an expert's mean load,
    a power of two in [16, 256] (peers model: 16 at 64 tokens, 256 at 4096 were fastest)."""
    target = max(1, n_assignments // (4 * n_experts))
    return int(min(256, max(16, 2 ** round(math.log2(target)))))


def _expert_windows(starts_E, counts_E, window: int, i, per_window, carry):
    """`per_window(lo, mine, carry)` over expert i's windows of the expert-sorted rows: `lo` the
    window's first row, `mine` [window, 1] True on the rows that are expert i's (the last
    window's tail belongs to the next expert)."""
    def rows(j, carry):
        mine = (j * window + jnp.arange(window) < counts_E[i])[:, None]
        return per_window(starts_E[i] + j * window, mine, carry)

    return jax.lax.fori_loop(0, (counts_E[i] + window - 1) // window, rows, carry)


def _put_rows(buf, rows_RxD, lo, mine):
    """`buf` with its rows [lo, lo + R) set to `rows_RxD` where `mine`, kept elsewhere."""
    r = rows_RxD.shape[0]
    kept = jnp.where(mine, rows_RxD, jax.lax.dynamic_slice_in_dim(buf, lo, r))
    return jax.lax.dynamic_update_slice_in_dim(buf, kept, lo, 0)


def _windows(xs_PxD, starts_E, counts_E, w, window: int, save: bool, skip_idle: bool = False):
    """SwiGLU of each expert's rows of the expert-sorted `xs_PxD` (expert i's at starts_E[i],
    counts_E[i] of them; P = rows + one window of zeros), in windows of `window` rows: a loop
    over the experts reads each expert's weights once; each runs as many windows as it has
    rows. Returns the outputs, and with `save` also the gate and up projections. `skip_idle`:
    experts without rows are skipped (their weights not read), for sparse loads."""
    wg_ExDxF, wu_ExDxF, wo_ExFxD = w
    init = (jnp.zeros_like(xs_PxD),)
    if save:
        zeros_PxF = jnp.zeros((xs_PxD.shape[0], wg_ExDxF.shape[-1]), xs_PxD.dtype)
        init += (zeros_PxF, zeros_PxF)

    def expert(i, bufs):
        wg, wu, wo = wg_ExDxF[i], wu_ExDxF[i], wo_ExFxD[i]  # read once per expert

        def per_window(lo, mine, bufs):
            x = jax.lax.dynamic_slice_in_dim(xs_PxD, lo, window)
            g, u = jnp.dot(x, wg), jnp.dot(x, wu)
            out = (_put_rows(bufs[0], jnp.dot(nn.silu(g) * u, wo), lo, mine),)
            return out + ((_put_rows(bufs[1], g, lo, mine),
                           _put_rows(bufs[2], u, lo, mine)) if save else ())

        return _expert_windows(starts_E, counts_E, window, i, per_window, bufs)

    if skip_idle:
        expert = _skip_idle(expert, counts_E)
    return jax.lax.fori_loop(0, wg_ExDxF.shape[0], expert, init)


def _skip_idle(expert, counts_E):
    """`expert(i, carry)` run only for experts with rows."""
    return lambda i, carry: jax.lax.cond(counts_E[i] > 0, functools.partial(expert, i),
                                         lambda c: c, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 7))
def _expert_rows(xs_PxD, starts_E, counts_E, window, wg_ExDxF, wu_ExDxF, wo_ExFxD,
                 skip_idle=False):
    return _windows(xs_PxD, starts_E, counts_E, (wg_ExDxF, wu_ExDxF, wo_ExFxD), window,
                    save=False, skip_idle=skip_idle)[0]


def _expert_rows_fwd(xs_PxD, starts_E, counts_E, window, wg_ExDxF, wu_ExDxF, wo_ExFxD,
                     skip_idle=False):
    w = (wg_ExDxF, wu_ExDxF, wo_ExFxD)
    ys, g_PxF, u_PxF = _windows(xs_PxD, starts_E, counts_E, w, window, save=True,
                                skip_idle=skip_idle)
    return ys, (xs_PxD, starts_E, counts_E, w, g_PxF, u_PxF)


def _expert_rows_bwd(window, skip_idle, residuals, dys_PxD):
    """The same loops backwards by hand (loops with dynamic trip counts have no reverse mode):
    per window, the SwiGLU's input gradient and the expert's weight gradients (summed over its
    windows); rows of other experts get a zero output gradient."""
    xs_PxD, starts_E, counts_E, (wg_ExDxF, wu_ExDxF, wo_ExFxD), g_PxF, u_PxF = residuals

    def expert(i, grads):
        dxs, dwg_E, dwu_E, dwo_E = grads
        wgT, wuT, woT = wg_ExDxF[i].T, wu_ExDxF[i].T, wo_ExFxD[i].T  # once per expert

        def per_window(lo, mine, acc):
            dxs, dwg, dwu, dwo = acc
            sl = lambda buf: jax.lax.dynamic_slice_in_dim(buf, lo, window)
            x, g, u = sl(xs_PxD), sl(g_PxF), sl(u_PxF)
            dy = jnp.where(mine, sl(dys_PxD), 0)
            sig = jax.nn.sigmoid(g)
            silu = g * sig
            dh = jnp.dot(dy, woT)
            du = dh * silu
            dg = dh * u * (sig * (1 + g * (1 - sig)))
            dx = jnp.dot(dg, wgT) + jnp.dot(du, wuT)
            return (_put_rows(dxs, dx, lo, mine), dwg + jnp.dot(x.T, dg), dwu + jnp.dot(x.T, du),
                    dwo + jnp.dot((silu * u).T, dy))

        zero = tuple(jnp.zeros_like(w[0]) for w in (wg_ExDxF, wu_ExDxF, wo_ExFxD))
        dxs, dwg, dwu, dwo = _expert_windows(starts_E, counts_E, window, i, per_window,
                                             (dxs,) + zero)
        return dxs, dwg_E.at[i].set(dwg), dwu_E.at[i].set(dwu), dwo_E.at[i].set(dwo)

    init = (jnp.zeros_like(xs_PxD), jnp.zeros_like(wg_ExDxF), jnp.zeros_like(wu_ExDxF),
            jnp.zeros_like(wo_ExFxD))
    if skip_idle:
        expert = _skip_idle(expert, counts_E)
    dxs, dwg, dwu, dwo = jax.lax.fori_loop(0, wg_ExDxF.shape[0], expert, init)
    return dxs, None, None, dwg, dwu, dwo


_expert_rows.defvjp(_expert_rows_fwd, _expert_rows_bwd)


def first_block_size(n_assignments: int, n_experts: int) -> int:
    """Rows per expert of the looped dispatch's batched first block, 0 for none: the power of
    two >= twice an expert's mean load (at least 4), while that is at most 16 rows (decode
    steps and other small batches; at larger loads the looped windows are as fast)."""
    rows = 2 * -(-n_assignments // n_experts)
    return 0 if rows > 16 else max(4, 1 << (rows - 1).bit_length())


def _looped_rows(xs_AxD, starts_E, counts_E, window: int, w, skip_idle: bool = False):
    """`_expert_rows` of the expert-sorted rows (one window of zeros appended, so that every
    window slice stays in bounds)."""
    pad = jnp.zeros((window, xs_AxD.shape[-1]), xs_AxD.dtype)
    ys = _expert_rows(jnp.concatenate([xs_AxD, pad]), starts_E, counts_E, window, *w,
                      skip_idle)
    return ys[: xs_AxD.shape[0]]


def _blocked_rows(xs_AxD, sorted_e_A, rank_A, starts_E, counts_E, block: int, window: int, w):
    """SwiGLU of the expert-sorted rows: each expert's first `block` rows in one batched
    product over the experts, [E, block, D] (the weights read where they lie: no loop and no
    per-expert weight copies, which dominate a small batch's looped windows); the rows past
    an expert's first block (a load above `block`) by the looped windows over the experts
    that have such rows, skipped when none has."""
    a = xs_AxD.shape[0]
    r_B = jnp.arange(block)
    src_ExB = jnp.minimum(starts_E[:, None] + r_B, a - 1)
    x_ExBxD = jnp.where((r_B < counts_E[:, None])[..., None], xs_AxD[src_ExB], 0)
    y_ExBxD = expert_ffn(x_ExBxD, *w)
    in_block_A = rank_A < block
    ys_AxD = jnp.where(in_block_A[:, None],
                       y_ExBxD[sorted_e_A, jnp.minimum(rank_A, block - 1)], 0)
    over_E = jnp.maximum(counts_E - block, 0)

    def overflow(xs_AxD):
        # the rows past the first blocks, expert-sorted; in-block rows go to row a (dropped)
        ostarts_E = jnp.cumsum(over_E) - over_E
        opos_A = jnp.where(in_block_A, a, ostarts_E[sorted_e_A] + rank_A - block)
        xo_AxD = jnp.zeros_like(xs_AxD).at[opos_A].set(xs_AxD, mode="drop")
        yo_AxD = _looped_rows(xo_AxD, ostarts_E, over_E, window, w, skip_idle=True)
        return jnp.where(in_block_A[:, None], 0, yo_AxD[jnp.minimum(opos_A, a - 1)])

    return ys_AxD + jax.lax.cond(jnp.any(over_E > 0), overflow, jnp.zeros_like, xs_AxD)


def looped_dispatch(x_NxD, idx_Nxk, weights_Nxk, wg_ExDxF, wu_ExDxF, wo_ExFxD,
                    window: int | None = None, first_block: int | None = None) -> jax.Array:
    """Exact top-k MoE expert by expert, in windows of `window` rows (default `window_size`),
    after a batched first block of `first_block` rows per expert when that is > 0 (default
    `first_block_size`): see "dropless_loop" in the module docstring."""
    n, k = idx_Nxk.shape
    e, a = wg_ExDxF.shape[0], n * k
    window = window or window_size(a, e)
    first_block = first_block_size(a, e) if first_block is None else first_block
    order_A, sorted_e_A, rank_A, counts_E = _sort_by_expert(idx_Nxk.reshape(a), e)
    starts_E = jnp.cumsum(counts_E) - counts_E
    xs_AxD = x_NxD[order_A // k]
    w = (wg_ExDxF, wu_ExDxF, wo_ExFxD)
    if first_block:
        ys_AxD = _blocked_rows(xs_AxD, sorted_e_A, rank_A, starts_E, counts_E, first_block,
                               window, w)
    else:
        ys_AxD = _looped_rows(xs_AxD, starts_E, counts_E, window, w)
    dest_A = jnp.zeros(a, jnp.int32).at[order_A].set(jnp.arange(a, dtype=jnp.int32))
    return _combine(ys_AxD, dest_A, weights_Nxk)


def dropless_dispatch(x_NxD, idx_Nxk, weights_Nxk, wg_ExDxF, wu_ExDxF, wo_ExFxD,
                      block: int | None = None, loop: bool = False) -> jax.Array:
    """Exact top-k MoE with static shapes: expert groups padded to `block` rows. `loop`: expert
    by expert in windows of `block` rows (default `window_size`) instead (`looped_dispatch`:
    the same forward bit for bit, gradients equal up to float summation order)."""
    if loop:
        return looped_dispatch(x_NxD, idx_Nxk, weights_Nxk, wg_ExDxF, wu_ExDxF, wo_ExFxD, block)
    n, k = idx_Nxk.shape
    e = wg_ExDxF.shape[0]
    a = n * k
    b = block or block_size(a, e)
    order_A, sorted_e_A, rank_A, counts_E = _sort_by_expert(idx_Nxk.reshape(a), e)
    padded_E = (counts_E + b - 1) // b * b
    ends_E = jnp.cumsum(padded_E)
    pstart_E = ends_E - padded_E
    n_blocks = -(-(a + e * (b - 1)) // b)  # static upper bound on sum(padded_E) / b
    dest_sorted = pstart_E[sorted_e_A] + rank_A
    dest_A = jnp.zeros(a, jnp.int32).at[order_A].set(dest_sorted)
    x_GxRxD = _gather_rows(x_NxD, dest_A, k, n_blocks * b).reshape(n_blocks, b, -1)
    block_e = jnp.searchsorted(ends_E, jnp.arange(n_blocks) * b, side="right")
    block_e = jnp.minimum(block_e, e - 1)  # trailing all-padding blocks
    y = expert_ffn(x_GxRxD, wg_ExDxF[block_e], wu_ExDxF[block_e], wo_ExFxD[block_e])
    return _combine(y.reshape(n_blocks * b, -1), dest_A, weights_Nxk)


def capacity_dispatch(x_NxD, idx_Nxk, weights_Nxk, wg_ExDxF, wu_ExDxF, wo_ExFxD,
                      capacity_factor: float, valid_N: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """Each expert processes at most C = ceil(A/E * capacity_factor) assignments, real tokens
    (valid_N) before padding, earlier tokens first; returns (output, dropped fraction of the
    real tokens' assignments)."""
    n, k = idx_Nxk.shape
    e = wg_ExDxF.shape[0]
    a = n * k
    cap = max(1, math.ceil(a / e * capacity_factor))
    valid_A = None if valid_N is None else jnp.repeat(valid_N.astype(bool), k)
    order_A, sorted_e_A, rank_A, _ = _sort_by_expert(idx_Nxk.reshape(a), e, valid_A)
    keep = rank_A < cap
    dest_sorted = jnp.where(keep, sorted_e_A * cap + rank_A, e * cap)  # e*cap: dropped
    dest_A = jnp.zeros(a, jnp.int32).at[order_A].set(dest_sorted)
    x_ExCxD = _gather_rows(x_NxD, dest_A, k, e * cap).reshape(e, cap, -1)
    y = expert_ffn(x_ExCxD, wg_ExDxF, wu_ExDxF, wo_ExFxD)
    if valid_A is None:
        dropped = jnp.sum(~keep).astype(jnp.float32) / a
    else:
        valid_sorted = valid_A[order_A]
        dropped = jnp.sum(~keep & valid_sorted) / jnp.maximum(jnp.sum(valid_sorted), 1)
    return _combine(y.reshape(e * cap, -1), dest_A, weights_Nxk), dropped


def ragged_dispatch(x_NxD, idx_Nxk, weights_Nxk, wg_ExDxF, wu_ExDxF, wo_ExFxD) -> jax.Array:
    """Exact top-k MoE with `lax.ragged_dot` over the expert-sorted assignments."""
    n, k = idx_Nxk.shape
    e = wg_ExDxF.shape[0]
    a = n * k
    order_A, _, _, counts_E = _sort_by_expert(idx_Nxk.reshape(a), e)
    xs_AxD = x_NxD[order_A // k]
    h = nn.silu(jax.lax.ragged_dot(xs_AxD, wg_ExDxF, counts_E)) * jax.lax.ragged_dot(
        xs_AxD, wu_ExDxF, counts_E
    )
    ys_AxD = jax.lax.ragged_dot(h, wo_ExFxD, counts_E)
    dest_A = jnp.zeros(a, jnp.int32).at[order_A].set(jnp.arange(a, dtype=jnp.int32))
    return _combine(ys_AxD, dest_A, weights_Nxk)


def dense_dispatch(x_NxD, idx_Nxk, weights_Nxk, wg_ExDxF, wu_ExDxF, wo_ExFxD) -> jax.Array:
    """Every expert on every token; non-selected experts get weight zero."""
    e = wg_ExDxF.shape[0]
    gates_NxE = jnp.sum(jax.nn.one_hot(idx_Nxk, e, dtype=x_NxD.dtype)
                        * weights_Nxk[..., None].astype(x_NxD.dtype), axis=1)
    x_ExNxD = jnp.broadcast_to(x_NxD, (e,) + x_NxD.shape)
    y_ExNxD = expert_ffn(x_ExNxD, wg_ExDxF, wu_ExDxF, wo_ExFxD)
    return jnp.einsum("end,ne->nd", y_ExNxD, gates_NxE)


