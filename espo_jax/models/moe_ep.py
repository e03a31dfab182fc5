"""Expert-parallel MoE dispatch: each device routes and sorts only its own tokens, an all-to-all
over the mesh's `expert` axis carries each assignment to the device that owns its expert, the
local experts run, and a second all-to-all brings the outputs back (MaxText's `sparse_matmul`
layout; our own code).

`moe.MoeBlock` takes this path when it is traced under a mesh whose `expert` axis is > 1
(`sharding.activation_sharding`: the learner's steps): the tokens are the activations' batch
shards (the `batch` rule, which includes `expert`, so the devices of an expert group hold
different tokens), the expert weights [E, D, F] arrive split over `expert` (E / ep each; their
other axes gathered, as FSDP does). Per device, with n local tokens, k experts each, a = n k
assignments, ep devices on `expert`, L = E / ep local experts:

1. sort the a assignments by expert, hence by owning device (local: no global sort);
2. exchange: the rows for device d go to d, which lays the rows it receives out by source,
   contiguously, in a buffer of R = ep x `slot` rows. Dropless (the default) `slot` = a, the
   worst case (every device sends all it has to one); with `ModelConfig.dispatch="capacity"`
   `slot` = ceil(capacity_factor x a / ep), and assignments past a source's `slot` rows for
   one device are dropped (their output is zero) and counted in `moe/dropped_frac`;
3. each received row's local expert from the exchanged counts per (source, expert); the local
   experts run over the rows (a grouped `lax.ragged_dot` for `dispatch="ragged"`, else the
   exact dropless dispatch of `moe_dispatch`);
4. the reverse exchange puts each output where its assignment was, and the gates combine them.

The dropless buffer holds ep x a rows, ep times what a device sends: at 16k tokens per device,
top-8 and ep 8 that is a million rows of D per buffer. `ModelConfig.ep_chunk` = c > 0 runs steps
1-4 over the device's tokens in chunks of at most c (a `lax.map`, each chunk under
`jax.checkpoint`, so the backward pass holds one chunk's buffers at a time, not all of them):
the buffers shrink to ep x c x k rows, still dropless, for one more forward of the experts.
A chunk's padding tokens (when c does not divide n) are sent nowhere. With capacity dispatch,
`slot` applies to each chunk.

The exchange is `lax.ragged_all_to_all` on accelerators. XLA:CPU does not implement it
(jaxlib 0.10.2, jax-ml/jax#34755), so on CPU a dense `lax.all_to_all` of [ep, slot, D] buffers
(each source's rows padded to `slot`) stands in: the same rows reach the same places, so the
outputs are equal; it moves ep x more bytes, which only the CPU tests pay.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from espo_jax import mesh_rules
from espo_jax.models.moe_dispatch import _combine, _sort_by_expert, dropless_dispatch

EXPERT_AXIS = "expert"


def active_mesh(n_experts: int):
    """The mesh the MoE layer is being traced under when it is expert parallel (an `expert`
    axis > 1 that divides the experts), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return None
    ep = mesh.shape[EXPERT_AXIS]
    return mesh if ep > 1 and n_experts % ep == 0 else None


def batch_axes() -> tuple[str, ...]:
    """The mesh axes of the `batch` logical axis under the rules the model is traced with."""
    return mesh_rules.batch_axes(nn.get_logical_axis_rules())


def ep_route(route_fn, logits_NxE, bias_E, replay_Nxk, *, mesh):
    """`route_fn(logits_NxE, bias_E, replay_Nxk)` on each device's own tokens: a token's routes
    are its own business, but XLA partitions no top-k over the batch and would gather the
    mesh's router logits to pick them."""
    tok = P(batch_axes())
    args = {"logits": logits_NxE, "bias": bias_E, "replay": replay_Nxk}
    specs = {"logits": tok, "bias": None if bias_E is None else P(),
             "replay": None if replay_Nxk is None else tok}
    return jax.shard_map(lambda a: route_fn(a["logits"], a["bias"], a["replay"]), mesh=mesh,
                         in_specs=(specs,), out_specs=tok, check_vma=False)(args)


def ep_dispatch(x_NxD, idx_Nxk, weights_Nxk, wg_ExDxF, wu_ExDxF, wo_ExFxD, *, mesh,
                local: str = "dropless_loop", capacity_factor: float | None = None,
                chunk: int = 0):
    """The MoE output [N, D] and the dropped fraction of the assignments, expert parallel over
    `mesh`'s `expert` axis (see the module docstring); `local` names the local experts'
    dispatch ("ragged": grouped matmul; else the exact dropless one, "dropless_loop" looped);
    `chunk` > 0: tokens per device per exchange."""
    axes = batch_axes()
    if EXPERT_AXIS not in axes:
        raise ValueError(f"expert-parallel MoE needs the batch split over '{EXPERT_AXIS}' too "
                         f"(the `batch` rule maps to {axes}); add it to config.mesh.rules")
    tok = P(axes)
    fn = functools.partial(_chunked, local=local, capacity_factor=capacity_factor,
                           ragged=mesh.abstract_device.platform != "cpu", batch=axes,
                           chunk=chunk)
    w = P(EXPERT_AXIS)
    return jax.shard_map(fn, mesh=mesh, in_specs=(tok, tok, tok, w, w, w),
                         out_specs=(tok, P()), check_vma=False)(
        x_NxD, idx_Nxk, weights_Nxk, wg_ExDxF, wu_ExDxF, wo_ExFxD)


def _offsets(sizes_P):
    return jnp.cumsum(sizes_P) - sizes_P


def _chunked(x_NxD, idx_Nxk, weights_Nxk, wg_LxDxF, wu_LxDxF, wo_LxFxD, *, chunk, batch,
             **kw):
    """One device's MoE output [n, D] and the dropped fraction, its tokens exchanged in
    ceil(n / chunk) chunks of equal size m (the last padded with tokens that go nowhere)."""
    n, k = idx_Nxk.shape
    w = (wg_LxDxF, wu_LxDxF, wo_LxFxD)
    if not chunk or chunk >= n:
        y_NxD, dropped = _local(x_NxD, idx_Nxk, weights_Nxk, *w, **kw)
        return y_NxD, _fraction(dropped, n * k, batch)
    c = -(-n // chunk)
    m = -(-n // c)
    pad = c * m - n
    real_N = jnp.arange(c * m) < n

    def split(v):
        return jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)).reshape(c, m, *v.shape[1:])

    def one(args):
        x, idx, wts, real = args
        return _local(x, idx, wts, *w, real_N=real, **kw)

    y_CxMxD, dropped_C = jax.lax.map(jax.checkpoint(one), (
        split(x_NxD), split(idx_Nxk), split(weights_Nxk), real_N.reshape(c, m)))
    return y_CxMxD.reshape(c * m, -1)[:n], _fraction(jnp.sum(dropped_C), n * k, batch)


def _fraction(dropped, assignments: int, batch):
    """The mesh's dropped assignments over its assignments."""
    return jax.lax.psum(dropped, batch) / jax.lax.psum(jnp.float32(assignments), batch)


def _local(x_NxD, idx_Nxk, weights_Nxk, wg_LxDxF, wu_LxDxF, wo_LxFxD, *, local,
           capacity_factor, ragged, real_N=None):
    """One exchange of a device's n tokens (those with `real_N` False are sent nowhere): their
    MoE output [n, D] and how many of their assignments were dropped."""
    ep = jax.lax.axis_size(EXPERT_AXIS)
    me = jax.lax.axis_index(EXPERT_AXIS)
    n, k = idx_Nxk.shape
    n_local = wg_LxDxF.shape[0]
    a = n * k
    slot = a if capacity_factor is None else max(1, math.ceil(capacity_factor * a / ep))
    idx_A = idx_Nxk.reshape(a)
    if real_N is not None:  # padding sorts after every expert's rows, counted by none
        idx_A = jnp.where(jnp.repeat(real_N, k), idx_A, n_local * ep)
    order_A, sorted_e_A, _, counts_E = _sort_by_expert(idx_A, n_local * ep + 1)
    counts_E = counts_E[:-1]
    xs_AxD = x_NxD[order_A // k]
    counts_PxL = counts_E.reshape(ep, n_local)  # my rows per (device, its local expert)
    want_P = counts_PxL.sum(1)
    send_P = jnp.minimum(want_P, slot)
    start_P = _offsets(want_P)  # where device p's rows begin in my sorted rows
    # what each source sends me: its counts per my local expert, and the clipped totals
    recv_PxL = jax.lax.all_to_all(counts_PxL, EXPERT_AXIS, 0, 0, tiled=True)
    recv_P = jax.lax.all_to_all(send_P, EXPERT_AXIS, 0, 0, tiled=True)
    recv_start_P = _offsets(recv_P)
    rows = ep * slot
    # each received row's source and place in that source's block; rows past the received
    # ones are invalid
    i_R = jnp.arange(rows)
    src_R = jnp.clip(jnp.searchsorted(jnp.cumsum(recv_P), i_R, side="right"), 0, ep - 1)
    r_R = i_R - recv_start_P[src_R]
    valid_R = i_R < jnp.sum(recv_P)
    # each of my sorted assignments' device and place in my block for it
    dev_A = jnp.minimum(sorted_e_A // n_local, ep - 1)
    rank_A = jnp.arange(a) - start_P[dev_A]
    real_A = sorted_e_A < n_local * ep
    kept_A = (rank_A < slot) & real_A

    if ragged:  # where my rows land on each receiver, where theirs landed on me
        sent_PxP = jax.lax.all_gather(send_P, EXPERT_AXIS)  # [source, receiver]
        before_P = jnp.sum(jnp.where(jnp.arange(ep)[:, None] < me, sent_PxP, 0), axis=0)
        xr_RxD = jax.lax.ragged_all_to_all(
            xs_AxD, jnp.zeros((rows, xs_AxD.shape[1]), xs_AxD.dtype), start_P, send_P,
            before_P, recv_P, axis_name=EXPERT_AXIS)
    else:
        xr_RxD = _dense_exchange(xs_AxD, start_P, send_P, src_R, r_R, valid_R, slot)

    # each received row's local expert
    ends_RxL = jnp.cumsum(recv_PxL, axis=1)[src_R]
    le_R = jnp.minimum(jnp.sum(ends_RxL <= r_R[:, None], axis=1), n_local - 1)
    yr_RxD = _local_experts(xr_RxD, le_R, valid_R, (wg_LxDxF, wu_LxDxF, wo_LxFxD), local)

    if ragged:  # back to where each row came from: my start for it there
        starts_PxP = jax.lax.all_gather(start_P, EXPERT_AXIS)  # [source, receiver]
        ys_AxD = jax.lax.ragged_all_to_all(
            yr_RxD, jnp.zeros_like(xs_AxD), recv_start_P, recv_P, starts_PxP[:, me], send_P,
            axis_name=EXPERT_AXIS)
    else:
        ys_AxD = _dense_return(yr_RxD, recv_start_P, recv_P, dev_A, rank_A, kept_A, slot)
    ys_AxD = jnp.where(kept_A[:, None], ys_AxD, 0)
    dest_A = jnp.zeros(a, jnp.int32).at[order_A].set(jnp.arange(a, dtype=jnp.int32))
    dropped = jnp.sum(real_A & ~kept_A).astype(jnp.float32)
    return _combine(ys_AxD, dest_A, weights_Nxk), dropped


def _dense_exchange(xs_AxD, start_P, send_P, src_R, r_R, valid_R, slot):
    """The CPU stand-in for the forward ragged all-to-all: device p's rows padded to `slot` in
    an [ep, slot, D] buffer, a dense all-to-all, the received blocks laid out contiguously
    (row R: source `src_R`, place `r_R`)."""
    r_S = jnp.arange(slot)
    src_PxS = jnp.minimum(start_P[:, None] + r_S, xs_AxD.shape[0] - 1)
    buf = jnp.where((r_S < send_P[:, None])[..., None], xs_AxD[src_PxS], 0)
    got = jax.lax.all_to_all(buf, EXPERT_AXIS, 0, 0, tiled=True)  # [source, slot, D]
    return jnp.where(valid_R[:, None], got[src_R, jnp.minimum(r_R, slot - 1)], 0)


def _dense_return(yr_RxD, recv_start_P, recv_P, dev_A, rank_A, kept_A, slot):
    """The CPU stand-in for the reverse ragged all-to-all: each source's outputs padded to
    `slot` rows, a dense all-to-all back, each kept sorted assignment's row (device `dev_A`,
    place `rank_A`) picked out."""
    r_S = jnp.arange(slot)
    src_PxS = jnp.minimum(recv_start_P[:, None] + r_S, yr_RxD.shape[0] - 1)
    buf = jnp.where((r_S < recv_P[:, None])[..., None], yr_RxD[src_PxS], 0)
    back = jax.lax.all_to_all(buf, EXPERT_AXIS, 0, 0, tiled=True)  # [device, slot, D]
    return jnp.where(kept_A[:, None], back[dev_A, jnp.minimum(rank_A, slot - 1)], 0)


def _local_experts(x_RxD, le_R, valid_R, w, local: str):
    """SwiGLU of each valid row through its local expert (invalid rows: zero)."""
    if local == "ragged":
        n_local = w[0].shape[0]
        key_R = jnp.where(valid_R, le_R, n_local)  # invalid rows sort last, in no group
        order_R = jnp.argsort(key_R, stable=True)
        counts_L = jnp.zeros(n_local, jnp.int32).at[key_R].add(1, mode="drop")
        xs = x_RxD[order_R]
        h = nn.silu(jax.lax.ragged_dot(xs, w[0], counts_L)) * jax.lax.ragged_dot(
            xs, w[1], counts_L)
        ys = jax.lax.ragged_dot(h, w[2], counts_L)
        y_RxD = jnp.zeros_like(ys).at[order_R].set(ys)
        return jnp.where(valid_R[:, None], y_RxD, 0)
    gate_R1 = valid_R[:, None].astype(x_RxD.dtype)
    return dropless_dispatch(x_RxD, le_R[:, None], gate_R1, *w, loop=local == "dropless_loop")
