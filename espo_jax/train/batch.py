"""Learner batches: rollout groups -> fixed-shape arrays, length-balanced across data shards.

A batch has a fixed shape `[B, T]` (B = rows, T = max prompt + response length) so the train
step compiles once; rows beyond the real responses are all-masked and contribute nothing.
Row r holds `prompt + response` right-padded; `targets[r, t]` is the token at t + 1 and
`loss_mask[r, t]` is 1 where that target is a response token. Routing and behaviour log-probs
are aligned the same way (routing to inputs, log-probs to targets).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax
import jax
import numpy as np


@flax.struct.dataclass
class RLBatch:
    tokens: jax.Array  # [B, T] int32 inputs
    positions: jax.Array  # [B, T] int32
    targets: jax.Array  # [B, T] int32 next tokens
    loss_mask: jax.Array  # [B, T] float32, 1 on response targets
    advantages: jax.Array  # [B] float32 sequence advantages (GRPO etc.)
    zv_sign: jax.Array  # [B] float32: +1 all-correct / -1 all-wrong zero-variance group, else 0
    behaviour_logp: jax.Array  # [B, T] float32 sampler log-probs of the targets (0 off-mask)
    routed_experts: jax.Array | None  # [B, T, M, k] int32 recorded routing, -1 = none
    old_logp: jax.Array | None = None  # [B, T] filled by the old-policy pass
    old_entropy: jax.Array | None = None  # [B, T]
    old_routed_experts: jax.Array | None = None  # [B, T, M, k] learner's own old routing (R2)
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
) -> RLBatch:
    """Packs `prompt + response` pairs into an `RLBatch` of `rows x seq_len` (host numpy)."""
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
    order = balance_rows(lengths, n_shards, rows // n_shards)
    tokens = np.full((rows, seq_len), pad_id, np.int32)
    targets = np.full((rows, seq_len), pad_id, np.int32)
    loss_mask = np.zeros((rows, seq_len), np.float32)
    blogp = np.zeros((rows, seq_len), np.float32)
    adv = np.zeros((rows,), np.float32)
    zvs = np.zeros((rows,), np.float32)
    routed = None
    if moe_shape is not None:
        routed = np.full((rows, seq_len, *moe_shape), -1, np.int32)
    for row, i in enumerate(order):
        if i >= len(lengths):
            continue
        p, r = np.asarray(prompts[i]), np.asarray(responses[i])
        full = np.concatenate([p, r]).astype(np.int32)
        n_in = len(full) - 1
        tokens[row, :n_in] = full[:-1]
        targets[row, :n_in] = full[1:]
        # Target t is response token (t + 1 - len(p)); it is a response token when t >= len(p) - 1.
        loss_mask[row, len(p) - 1 : n_in] = 1.0
        blogp[row, len(p) - 1 : n_in] = np.asarray(behaviour_logps[i], np.float32)[: len(r)]
        adv[row] = advantages[i]
        zvs[row] = zv_sign[i]
        if routed is not None and routings is not None and routings[i] is not None:
            ri = np.asarray(routings[i])[:n_in].astype(np.int32)
            routed[row, : len(ri)] = ri
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
    return RLBatch(
        tokens=tokens,
        positions=positions,
        targets=targets,
        loss_mask=loss_mask,
        advantages=adv,
        zv_sign=zvs,
        behaviour_logp=blogp,
        routed_experts=routed,
    )
