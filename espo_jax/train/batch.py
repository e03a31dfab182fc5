"""Learner batches: rollout groups -> fixed-shape arrays, length-balanced across data shards.

A batch has a fixed shape `[B, T]` (B = rows, T = max prompt + response length) so the train
step compiles once; rows beyond the real responses are all-masked and contribute nothing.
Row r holds `prompt + response` right-padded; `targets[r, t]` is the token at t + 1 and
`loss_mask[r, t]` is 1 where that target is a response token. Routing and behaviour log-probs
are aligned the same way (routing to inputs, log-probs to targets).

Packing (`pack=True`): the model runs on `[R, W]` rows (W = `pack_len`, by default 2T: rows of
T leave little room beside a long sequence) that each hold several sequences one after the
other (`segment_ids` 1, 2, ... per sequence, 0 on padding; positions restart at each
sequence), R ~ the rows the tokens fill instead of one row per sequence: little compute on
padding. The loss side keeps the per-sequence `[B, T]` layout: `unpack[b, t]` is the flat index
into the `[R, W]` model outputs of sequence b's position t (R*W where there is none), so the
losses, advantages and aggregations are the unpacked ones, value for value. R is rounded up
to a multiple of 1/PACK_BUCKETS of the rows the unpacked tokens would fill (a few distinct
shapes, each compiled once). Where packed rows would hold no fewer positions than one row per
sequence (every sequence near the longest), the batch is not packed: the same positions, and
attention over rows half as long (bench peers' GRPO update, 64 sequences of 47 tokens: 0.312 ->
0.287 s).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax
import jax
import numpy as np

PACK_BUCKETS = 16  # packed row counts: multiples of 1/PACK_BUCKETS of the most they can be


@flax.struct.dataclass
class RLBatch:
    # Model side: [R, W] (R, W = B, T unless packed).
    tokens: jax.Array  # [R, W] int32 inputs (W = T unless packed)
    positions: jax.Array  # [R, W] int32
    targets: jax.Array  # [R, W] int32 next tokens
    segment_ids: jax.Array  # [R, W] int32: 1, 2, ... per sequence in the row, 0 = padding
    # Loss side: [B, T], one row per sequence.
    loss_mask: jax.Array  # [B, T] float32, 1 on response targets
    advantages: jax.Array  # [B] float32 sequence advantages (GRPO etc.)
    zv_sign: jax.Array  # [B] float32: +1 all-correct / -1 all-wrong zero-variance group, else 0
    behaviour_logp: jax.Array  # [B, T] float32 sampler log-probs of the targets (0 off-mask)
    routed_experts: jax.Array | None  # [R, W, M, k] int32 recorded routing, -1 = none
    unpack: jax.Array | None = None  # [B, T] int32 flat index into [R, W]; None: not packed
    old_logp: jax.Array | None = None  # [B, T] filled by the old-policy pass
    old_entropy: jax.Array | None = None  # [B, T]
    old_routed_experts: jax.Array | None = None  # [R, W, M, k] learner's own old routing (R2)
    ref_logp: jax.Array | None = None  # [B, T] reference policy's log-probs (KL penalty)


def rl_seq_len(config) -> int:
    """Columns of an RL row: prompt (bos included) + response, less the last token (a target)."""
    return config.rollout.max_prompt_len + config.rollout.max_new_tokens - 1


def balance_rows(lengths: Sequence[int], n_shards: int, rows_per_shard: int) -> list[int]:
    """Longest-processing-time assignment of sequences to data shards by token count.

    Returns a permutation `order` of length `n_shards * rows_per_shard` (padding rows are
    indices >= len(lengths)) such that shard d gets rows `order[d*R:(d+1)*R]`.
    """
    n = len(lengths)
    total = n_shards * rows_per_shard
    if n > total:
        raise ValueError(f"{n} sequences do not fit {n_shards} shards x {rows_per_shard} rows")
    load = [0] * n_shards
    shards: list[list[int]] = [[] for _ in range(n_shards)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        open_shards = [d for d in range(n_shards) if len(shards[d]) < rows_per_shard]
        d = min(open_shards, key=lambda d: (load[d], d))
        shards[d].append(i)
        load[d] += lengths[i]
    pad = iter(range(n, total))
    for s in shards:
        s.extend(next(pad) for _ in range(rows_per_shard - len(s)))
    return [i for s in shards for i in s]


def fill_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing: sequences (by index) per row of `seq_len` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = next((j for j, f in enumerate(free) if f >= lengths[i]), None)
        if j is None:
            rows.append([])
            free.append(seq_len)
            j = len(rows) - 1
        rows[j].append(i)
        free[j] -= lengths[i]
    return rows


def pack_sequences(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    behaviour_logps: Sequence[np.ndarray],
    routings: Sequence[np.ndarray | None] | None,
    advantages: np.ndarray,
    zv_sign: np.ndarray,
    *,
    rows: int,
    seq_len: int,
    pad_id: int,
    n_shards: int = 1,
    moe_shape: tuple[int, int] | None = None,
    pack: bool = False,
    pack_len: int = 0,
) -> RLBatch:
    """Puts `prompt + response` pairs into an `RLBatch` of `rows x seq_len` (host numpy);
    with `pack`, its model side in as few rows of `pack_len` tokens (0: 2 * seq_len) as the
    tokens fill (module docstring)."""
    if rows % n_shards:
        raise ValueError(f"batch rows {rows} not divisible by data shards {n_shards}")
    for i, (p, r, lp) in enumerate(zip(prompts, responses, behaviour_logps, strict=True)):
        if len(p) < 1:
            raise ValueError(f"sequence {i} has an empty prompt: the first input must be a prompt "
                             "token (e.g. BOS) so the first response token has a position")
        if len(lp) < len(r):
            raise ValueError(f"sequence {i} has {len(r)} response tokens but {len(lp)} behaviour "
                             "log-probs")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    if lengths and max(lengths) > seq_len + 1:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds seq_len + 1 = {seq_len + 1}")
    per_shard = rows // n_shards
    order = balance_rows(lengths, n_shards, per_shard)
    width = (pack_len or 2 * seq_len) if pack else seq_len  # model-side row length
    if width < seq_len:
        raise ValueError(f"pack_len {pack_len} is shorter than a sequence row ({seq_len})")
    # Where each sequence's inputs go on the model side: (model row, first column, segment id).
    place: dict[int, tuple[int, int, int]] = {}
    if pack:
        shards = [[i for i in order[d * per_shard:(d + 1) * per_shard] if i < len(lengths)]
                  for d in range(n_shards)]
        filled = [fill_rows([lengths[i] - 1 for i in shard], width) for shard in shards]
        most = -(-per_shard * seq_len // width)  # rows of `width` the unpacked tokens fill
        step = max(1, most // PACK_BUCKETS)
        model_per_shard = min(most, -(-max(1, *map(len, filled)) // step) * step)
        # Rows that save no positions (sequences near the longest): one row per sequence
        # instead, the same work at half the attention row length.
        pack = model_per_shard * width < per_shard * seq_len
        width = width if pack else seq_len
    if pack:
        for d, (shard, shard_rows) in enumerate(zip(shards, filled, strict=True)):
            for j, members in enumerate(shard_rows):
                col = 0
                for segment, m in enumerate(members, start=1):
                    place[shard[m]] = (d * model_per_shard + j, col, segment)
                    col += lengths[shard[m]] - 1
        model_rows = n_shards * model_per_shard
    else:
        place = {i: (row, 0, 1) for row, i in enumerate(order) if i < len(lengths)}
        model_rows = rows
    tokens = np.full((model_rows, width), pad_id, np.int32)
    targets = np.full((model_rows, width), pad_id, np.int32)
    # Unpacked rows count positions through their padding too (as they always did).
    positions = (np.zeros((model_rows, width), np.int32) if pack else
                 np.broadcast_to(np.arange(width, dtype=np.int32), (model_rows, width)).copy())
    segments = np.zeros((model_rows, width), np.int32)
    loss_mask = np.zeros((rows, seq_len), np.float32)
    blogp = np.zeros((rows, seq_len), np.float32)
    adv = np.zeros((rows,), np.float32)
    zvs = np.zeros((rows,), np.float32)
    unpack = np.full((rows, seq_len), model_rows * width, np.int32) if pack else None
    routed = None
    if moe_shape is not None:
        routed = np.full((model_rows, width, *moe_shape), -1, np.int32)
    for row, i in enumerate(order):
        if i >= len(lengths):
            continue
        p, r = np.asarray(prompts[i]), np.asarray(responses[i])
        full = np.concatenate([p, r]).astype(np.int32)
        n_in = len(full) - 1
        mrow, col, segment = place[i]
        cols = slice(col, col + n_in)
        tokens[mrow, cols] = full[:-1]
        targets[mrow, cols] = full[1:]
        positions[mrow, cols] = np.arange(n_in)
        segments[mrow, cols] = segment
        if unpack is not None:
            unpack[row, :n_in] = mrow * width + col + np.arange(n_in)
        # Target t is response token (t + 1 - len(p)); it is a response token when t >= len(p) - 1.
        loss_mask[row, len(p) - 1 : n_in] = 1.0
        blogp[row, len(p) - 1 : n_in] = np.asarray(behaviour_logps[i], np.float32)[: len(r)]
        adv[row] = advantages[i]
        zvs[row] = zv_sign[i]
        if routed is not None and routings is not None and routings[i] is not None:
            ri = np.asarray(routings[i])[:n_in].astype(np.int32)
            routed[mrow, col : col + len(ri)] = ri
    return RLBatch(
        tokens=tokens,
        positions=positions,
        targets=targets,
        segment_ids=segments,
        loss_mask=loss_mask,
        advantages=adv,
        zv_sign=zvs,
        behaviour_logp=blogp,
        routed_experts=routed,
        unpack=unpack,
    )
