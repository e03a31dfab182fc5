"""Learner batches: rollout groups -> fixed-shape arrays, length-balanced across data shards.

A batch has a fixed shape `[B, T]` (B = rows, T = max prompt + response length) so the train
step compiles once; rows beyond the real responses are all-masked and contribute nothing.
Row r holds `prompt + response` right-padded; `targets[r, t]` is the token at t + 1 and
`loss_mask[r, t]` is 1 where that target is a response token. Routing and behaviour log-probs
are aligned the same way (routing to inputs, log-probs to targets).

Packing (`pack=True`): the model runs on `[R, W]` rows (W = `pack_len`, by default 2T: rows of T
leave little room beside a long sequence) that each hold several sequences one after the other
(`segment_ids` 1, 2, ... per sequence, 0 on padding; positions restart at each sequence), R ~
the rows the tokens fill instead of one row per sequence: little compute on padding. The loss
side keeps the per-sequence `[B, T]` layout: `unpack[b, t]` is the flat index into the `[R, W]`
model outputs of sequence b's position t (R*W where there is none), so the losses, advantages
and aggregations are the unpacked ones, value for value. Over several data shards (`n_shards`,
`RLBatch.shards`) shard d's sequences are packed into shard d's R / n_shards rows, and its index
maps count within those: flat indices into the shard's own rows (their count where there is
none), so bringing the outputs back gathers on each device from its own rows (with global
indices GSPMD all-gathered every device's hidden states for the gather, through an all-to-all:
`tests/train/test_packing.py`). R is rounded up to a multiple of 1/PACK_BUCKETS of the rows the
unpacked tokens would fill (a few distinct shapes, each compiled once). Where packed rows would
hold no fewer positions than one row per sequence (every sequence near the longest), the batch
is not packed: the same positions, and attention over rows half as long (bench peers' GRPO
update, 64 sequences of 47 tokens: 0.312 -> 0.287 s).

Head positions (`head_len` K > 0): the vocabulary projection, the costliest product of a
small model's gradient (SmolLM2-135M: a 49,152 x 576 head against 30 layers of 3.5M
parameters), runs only where a target can be on the loss mask: at each sequence's K
response targets (`head_index`), brought back to the loss's `[B, T]` by `head_unpack`.
Prompt positions and padding compute no logits (in `bench real`'s packed batch 2,048 of
3,744 positions remain).

Shared prompts (`share_prompts=True`, with packing): the responses of one prompt (equal prompt
tokens and recorded prompt routing, `prompt_keys`) are placed in one data shard, and in a row
as one copy of the prompt's first P - 1 inputs (segment id g * PREFIX_STRIDE) followed by each
response's own inputs from input P - 1 on (segment ids g * PREFIX_STRIDE + 1, 2, ..., the
positions continuing the prompt's), each attending to the copy and to itself
(`models.attention.segment_visible`): every log-prob is the one its own row would give, and G
responses compute their prompt once instead of G times. `token_weights` counts a shared
token once per response in the MoE aux losses and the routing flip rate. A prompt whose
responses do not fit one row is copied once per row they take.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import flax
import jax
import numpy as np

from espo_jax.models.attention import PREFIX_STRIDE

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
    # [R, W] float32 aux-loss weight of each model-side token: 1 on a real token, a shared
    # prompt's once per response, 0 on padding and on a response whose reward failed
    token_weights: jax.Array | None = None
    # [B, K] int32, sequence b's K response-target positions on the model side: the column of
    # row b unpacked, the flat index into [R, W] packed (R*W: none); None: every position
    head_index: jax.Array | None = None
    # [B, T] int32, column k of the head's [B, K] output holding (b, t) (K: none)
    head_unpack: jax.Array | None = None
    # [B] float32, 1 where the sequence was sampled by an older policy than the learner's (the
    # worker layout's staleness), and [R, W] the same per model-side token; None: not told
    stale: jax.Array | None = None
    stale_tokens: jax.Array | None = None
    # The data shards the batch is made for (static: one value per learner); packed rows'
    # index maps (`unpack`, `head_index`) count within the shard's own R / shards rows for its
    # B / shards sequences (module docstring)
    shards: int = flax.struct.field(pytree_node=False, default=1)


def rl_seq_len(config) -> int:
    """Columns of an RL row: prompt (bos included) + response, less the last token (a target)."""
    if not config.rollout.max_prompt_len:
        raise ValueError("rollout.max_prompt_len=0 is sized from the task's prompts "
                         "(`task_prompts.size_prompt_len`, in `run_setup.build`) before a learner "
                         "is made")
    return config.rollout.max_prompt_len + config.rollout.max_new_tokens - 1


def balance_rows(lengths: Sequence[int], n_shards: int, rows_per_shard: int,
                 keys: Sequence[Hashable] | None = None) -> list[int]:
    """Longest-processing-time assignment of sequences to data shards by token count.

    Returns a permutation `order` of length `n_shards * rows_per_shard` (padding rows are
    indices >= len(lengths)) such that shard d gets rows `order[d*R:(d+1)*R]`. With `keys`,
    sequences of one key (the responses of one prompt) are placed together, as one item, on
    a shard with room for them all (split only where no shard has), so that they can share
    their prompt (`pack_sequences(share_prompts=True)`).
    """
    n = len(lengths)
    total = n_shards * rows_per_shard
    if n > total:
        raise ValueError(f"{n} sequences do not fit {n_shards} shards x {rows_per_shard} rows")
    items: dict[Hashable, list[int]] = {}
    for i in range(n):
        items.setdefault(i if keys is None else keys[i], []).append(i)
    load = [0] * n_shards
    shards: list[list[int]] = [[] for _ in range(n_shards)]
    work = lambda item: sum(lengths[i] for i in item)
    for item in sorted(items.values(), key=lambda item: (-work(item), item[0])):
        room = [d for d in range(n_shards) if len(shards[d]) + len(item) <= rows_per_shard]
        for part in [item] if room else [[i] for i in item]:
            open_shards = room or [d for d in range(n_shards)
                                   if len(shards[d]) < rows_per_shard]
            d = min(open_shards, key=lambda d: (load[d], d))
            shards[d].extend(part)
            load[d] += work(part)
    pad = iter(range(n, total))
    for s in shards:
        s.extend(next(pad) for _ in range(rows_per_shard - len(s)))
    return [i for s in shards for i in s]


def balanced_parts(lengths: Sequence[int], n_parts: int, rows_per_part: int,
                   keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """`balance_rows` as each part's sequence indices (its padding rows left out)."""
    order = balance_rows(lengths, n_parts, rows_per_part, keys)
    return [[i for i in order[d * rows_per_part:(d + 1) * rows_per_part] if i < len(lengths)]
            for d in range(n_parts)]


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


def prompt_keys(prompts: Sequence[np.ndarray],
                routings: Sequence[np.ndarray | None] | None) -> list[bytes]:
    """Sequences whose prompts can be computed once: equal prompt tokens and, where routing
    was recorded, equal routing of the prompt's inputs (the replayed prefix must be the
    same for every response)."""
    keys = []
    for i, p in enumerate(prompts):
        p = np.asarray(p, np.int32)
        r = None if routings is None else routings[i]
        routing = b"" if r is None else np.asarray(r, np.int32)[: len(p) - 1].tobytes()
        keys.append(len(p).to_bytes(4, "little") + p.tobytes() + routing)
    return keys


def _units(shard: list[int], keys: list[bytes], prompt_lens: list[int],
           resp_lens: list[int], width: int, share: bool) -> list[list[int]]:
    """A shard's sequences as packing units: a single sequence, or (`share`) a prompt's
    responses behind one copy of the prompt, as many as fit in a row of `width` (a prompt of
    one token, or a response alone, stays a single sequence)."""
    groups: dict[bytes, list[int]] = {}
    for i in shard:
        groups.setdefault(keys[i] if share and prompt_lens[i] > 1 else i, []).append(i)
    units = []
    for members in groups.values():
        prefix = prompt_lens[members[0]] - 1
        unit, used = [], prefix
        for i in sorted(members, key=lambda i: (-resp_lens[i], i)):
            if unit and used + resp_lens[i] > width:
                units.append(unit)
                unit, used = [], prefix
            unit.append(i)
            used += resp_lens[i]
        units.append(unit)
    return units


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
    share_prompts: bool = False,
    trained: Sequence[bool] | None = None,
    head_len: int = 0,
    stale: Sequence[bool] | None = None,
) -> RLBatch:
    """Puts `prompt + response` pairs into an `RLBatch` of `rows x seq_len` (host numpy);
    with `pack`, its model side in as few rows of `pack_len` tokens (0: 2 * seq_len) as the
    tokens fill (module docstring); with `share_prompts` too, the responses of one prompt
    share one copy of it. `trained` (one bool per sequence; None: all True): a sequence marked
    False is placed like the others but its `loss_mask` row stays 0 and its tokens weigh 0 in
    `token_weights` (a response whose reward call failed: no loss term, no token in the loss's
    denominators, its routing not in the MoE aux losses). `head_len` > 0: the most
    response tokens a sequence has (`rollout.max_new_tokens`), the head's positions per
    sequence (module docstring). `stale` (one bool per sequence): sampled by an older policy
    (`RLBatch.stale`, the mismatch metrics' split); None: the batch carries no such arrays."""
    if rows % n_shards:
        raise ValueError(f"batch rows {rows} not divisible by data shards {n_shards}")
    for name, flags in (("trained", trained), ("stale", stale)):
        if flags is not None and len(flags) != len(prompts):
            raise ValueError(f"{name} has {len(flags)} entries for {len(prompts)} sequences")
    for i, (p, r, lp) in enumerate(zip(prompts, responses, behaviour_logps, strict=True)):
        if len(p) < 1:
            raise ValueError(f"sequence {i} has an empty prompt: the first input must be a prompt "
                             "token (e.g. BOS) so the first response token has a position")
        if len(lp) < len(r):
            raise ValueError(f"sequence {i} has {len(r)} response tokens but {len(lp)} behaviour "
                             "log-probs")
    if head_len and max((len(r) for r in responses), default=0) > head_len:
        raise ValueError(f"a response of {max(len(r) for r in responses)} tokens exceeds "
                         f"head_len = {head_len} (rollout.max_new_tokens)")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    if lengths and max(lengths) > seq_len + 1:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds seq_len + 1 = {seq_len + 1}")
    # (rows in the same order whether or not they end up packed)
    keys = prompt_keys(prompts, routings) if share_prompts else None
    share_prompts = share_prompts and pack
    prompt_lens = [len(p) for p in prompts]
    per_shard = rows // n_shards
    order = balance_rows(lengths, n_shards, per_shard, keys)
    width = (pack_len or 2 * seq_len) if pack else seq_len  # model-side row length
    if width < seq_len:
        raise ValueError(f"pack_len {pack_len} is shorter than a sequence row ({seq_len})")
    # Where each sequence's inputs go on the model side: (model row, first column, segment
    # id); a shared prompt's responses also (model row, first column) of the prompt's copy,
    # which holds its first P - 1 inputs (the response's row then starts at input P - 1).
    place: dict[int, tuple[int, int, int]] = {}
    prefix_at: dict[int, tuple[int, int]] = {}
    if pack:
        shards = [[i for i in order[d * per_shard:(d + 1) * per_shard] if i < len(lengths)]
                  for d in range(n_shards)]
        resp_lens = [n - p for n, p in zip(lengths, prompt_lens, strict=True)]
        units = [_units(shard, keys, prompt_lens, resp_lens, width, share_prompts)
                 for shard in shards]
        unit_len = lambda u: (lengths[u[0]] - 1 if len(u) == 1 else
                              prompt_lens[u[0]] - 1 + sum(resp_lens[i] for i in u))
        filled = [fill_rows([unit_len(u) for u in shard_units], width) for shard_units in units]
        most = -(-per_shard * seq_len // width)  # rows of `width` the unpacked tokens fill
        step = max(1, most // PACK_BUCKETS)
        model_per_shard = min(most, -(-max(1, *map(len, filled)) // step) * step)
        # Rows that save no positions (sequences near the longest): one row per sequence
        # instead, the same work at half the attention row length.
        pack = model_per_shard * width < per_shard * seq_len
        width = width if pack else seq_len
    if pack:
        for d, (shard_units, shard_rows) in enumerate(zip(units, filled, strict=True)):
            for j, members in enumerate(shard_rows):
                mrow, col, plain, group = d * model_per_shard + j, 0, 0, 0
                for u in (shard_units[m] for m in members):
                    if len(u) == 1:
                        plain += 1
                        place[u[0]] = (mrow, col, plain)
                        col += lengths[u[0]] - 1
                        continue
                    group += 1
                    pcol, col = col, col + prompt_lens[u[0]] - 1
                    for m, i in enumerate(u, start=1):
                        prefix_at[i] = (mrow, pcol)
                        place[i] = (mrow, col, group * PREFIX_STRIDE + m)
                        col += resp_lens[i]
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
    # always an array (the learner's programs take one batch structure): 1 on a real token, a
    # shared prompt's tokens once per response, 0 on a failed response's (not trained on)
    weights = np.zeros((model_rows, width), np.float32)
    stale_rows = None if stale is None else np.zeros((rows,), np.float32)
    stale_tokens = None if stale is None else np.zeros((model_rows, width), np.float32)
    loss_mask = np.zeros((rows, seq_len), np.float32)
    blogp = np.zeros((rows, seq_len), np.float32)
    adv = np.zeros((rows,), np.float32)
    zvs = np.zeros((rows,), np.float32)
    unpack = np.full((rows, seq_len), model_rows * width, np.int32) if pack else None
    head = head_unpack = None
    if head_len:
        head = np.full((rows, head_len), model_rows * width if pack else 0, np.int32)
        head_unpack = np.full((rows, seq_len), head_len, np.int32)
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
        # inputs [skip, n_in) go to this sequence's own columns; [0, skip) to its shared prompt
        skip = len(p) - 1 if i in prefix_at else 0
        cols = slice(col, col + n_in - skip)
        tokens[mrow, cols] = full[skip:-1]
        targets[mrow, cols] = full[skip + 1:]
        positions[mrow, cols] = np.arange(skip, n_in)
        segments[mrow, cols] = segment
        keep = trained is None or bool(trained[i])
        weights[mrow, cols] = float(keep)
        if stale is not None:  # a shared prompt's responses are one group's: one staleness
            stale_rows[row] = stale_tokens[mrow, cols] = float(stale[i])
        if unpack is not None:
            unpack[row, skip:n_in] = mrow * width + col + np.arange(n_in - skip)
        ri = None
        if routed is not None and routings is not None and routings[i] is not None:
            ri = np.asarray(routings[i])[:n_in].astype(np.int32)
            routed[mrow, col : col + max(0, len(ri) - skip)] = ri[skip:]
        if skip:
            prow, pcol = prefix_at[i]
            pcols = slice(pcol, pcol + skip)
            tokens[prow, pcols] = full[:skip]
            targets[prow, pcols] = full[1 : skip + 1]
            positions[prow, pcols] = np.arange(skip)
            segments[prow, pcols] = segment - segment % PREFIX_STRIDE
            weights[prow, pcols] += float(keep)  # the prompt stands for each trained copy
            if stale is not None:
                stale_tokens[prow, pcols] = float(stale[i])
            unpack[row, :skip] = prow * width + pcol + np.arange(skip)
            if ri is not None:
                routed[prow, pcol : pcol + min(skip, len(ri))] = ri[:skip]
        # Target t is response token (t + 1 - len(p)); it is a response token when t >= len(p) - 1.
        if head is not None:  # the targets t in [len(p) - 1, n_in): the response's tokens
            at = np.arange(len(p) - 1, n_in)
            head[row, : len(r)] = unpack[row, at] if pack else at
            head_unpack[row, at] = np.arange(len(r))
        if keep:
            loss_mask[row, len(p) - 1 : n_in] = 1.0
        blogp[row, len(p) - 1 : n_in] = np.asarray(behaviour_logps[i], np.float32)[: len(r)]
        adv[row] = advantages[i]
        zvs[row] = zv_sign[i]
    if pack and n_shards > 1:  # the index maps within each shard's own rows (module docstring)
        block = model_rows * width // n_shards
        first = (np.arange(rows) // per_shard * block)[:, None]
        for index in (a for a in (unpack, head) if a is not None):
            none = index == model_rows * width
            index -= first
            index[none] = block
            assert ((index >= 0) & (index <= block)).all(), "a sequence packed off its shard"
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
        token_weights=weights,
        stale=stale_rows,
        stale_tokens=stale_tokens,
        head_index=head,
        head_unpack=head_unpack,
        shards=n_shards,
    )
