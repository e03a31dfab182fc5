"""Continuous batching over the engine's fixed decode slots: requests in, prompt groups out.

`generate_groups(engine, requests, ...)` (also `Engine.generate_groups`) admits samples into free
slots (FIFO or longest predicted first), prefills `prefill_rows` prompts of one padded length per
call, inserts every sample admitted at a sync that shares a prefix block in one call, advances
all slots with the engine's `generate`, and reads every slot finished at a sync in one transfer.
A slot that finishes takes the next sample at once; the G samples of a prompt share one prefill.
Sample g of request i draws with `request_key(rng, seed_i, g)`: nothing depends on the slot or
the admission order, so groups come back the same in request order.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np

from espo_jax.rollout import scheduling
from espo_jax.rollout.decode import DONE, Prefix
from espo_jax.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to sample `n_samples` responses for (None: the driver's default G)."""

    prompt_id: Hashable
    tokens: Sequence[int]
    n_samples: int | None = None
    seed: int | None = None  # RNG stream of this request; default its index in the batch
    max_new_tokens: int | None = None  # None: the sampling config's


@dataclasses.dataclass
class Generation:
    """One response: fields named as `records.Response` so both feed `measure_mismatch`."""

    tokens: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R]
    routed_experts: np.ndarray | None  # int16 [P + R, M, k], -1 = no routing; None if dense
    finish_reason: str  # "stop" | "length"


@dataclasses.dataclass
class GenerationGroup:
    request_index: int
    prompt_id: Hashable
    prompt_tokens: np.ndarray  # int32 [P]
    responses: list[Generation]


def request_key(rng: jax.Array, seed: int, sample_idx: int) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(rng, seed), sample_idx)


@jax.jit
def _request_key_data(rng: jax.Array, seeds_R: jax.Array, samples_R: jax.Array) -> jax.Array:
    keys = jax.vmap(request_key, in_axes=(None, 0, 0))(rng, seeds_R, samples_R)
    return jax.random.key_data(keys)


def request_key_data(rng: jax.Array, seeds: Sequence[int], samples: Sequence[int],
                     pad_to: int = 0) -> np.ndarray:
    """`request_key(rng, seeds[r], samples[r])` for every r as raw key data on the host
    ([R, ...] uint32, what `Engine.insert_many` takes as keys): one compiled call for an
    admission round instead of two dispatches per sample; the call computes `pad_to` rows
    (when larger), so rounds of any size share one compiled shape."""
    r = len(seeds)
    rows = max(r, pad_to)
    seeds_R, samples_R = np.zeros(rows, np.uint32), np.zeros(rows, np.uint32)
    seeds_R[:r], samples_R[:r] = seeds, samples
    return np.asarray(_request_key_data(rng, seeds_R, samples_R))[:r]


# ---- the driver ---------------------------------------------------------------------------------
def check_requests(engine, requests: Sequence[Request], n_samples: int, sampling) -> None:
    for i, r in enumerate(requests):
        max_new = r.max_new_tokens or sampling.max_new_tokens
        limit = engine.max_cache_len - max_new
        if not 1 <= len(r.tokens) <= limit:
            raise ValueError(
                f"request {i} (prompt {r.prompt_id!r}) has {len(r.tokens)} prompt tokens; "
                f"need 1..{limit} (max_cache_len {engine.max_cache_len} - max_new_tokens "
                f"{max_new})"
            )
        if (r.n_samples or n_samples) < 1:
            raise ValueError(f"request {i}: n_samples must be >= 1")
        bad = [t for t in r.tokens if not 0 <= int(t) < engine.config.vocab_size]
        if bad:
            raise ValueError(
                f"request {i}: token ids {bad[:5]} outside the vocabulary "
                f"[0, {engine.config.vocab_size})"
            )

def collect(host: tuple, slot: int, stop_tokens) -> tuple[Generation, int]:
    """Slot `slot`'s response from `host` = device_get((pos_B, prompt_len_B, tokens_BxS,
    logprobs_BxS, experts_BxSxMxk)), one transfer for every slot finished at a sync."""
    pos_B, prompt_len_B, tokens_BxS, logprobs_BxS, experts = host
    pos, n = int(pos_B[slot]), int(prompt_len_B[slot])
    tokens = tokens_BxS[slot, n : pos + 1]
    stopped = int(tokens[-1]) in stop_tokens
    gen = Generation(
        np.array(tokens, np.int32),
        np.array(logprobs_BxS[slot, n : pos + 1], np.float32),
        np.array(experts[slot, : pos + 1], np.int16) if experts.shape[2] else None,
        "stop" if stopped else "length",
    )
    return gen, len(tokens)

def prefill_blocks(engine, requests: Sequence[Request]) -> list[list[int]]:
    """The request list cut into prefill calls: requests of one padded length, in index
    order, `prefill_rows` at a time. A prompt's prefix depends on its block (batched float
    sums), so blocks are fixed by the request list alone, never by admission timing."""
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_len.setdefault(engine.prefill_len(len(r.tokens)), []).append(i)
    return [idx[c : c + engine.prefill_rows] for _, idx in sorted(by_len.items())
            for c in range(0, len(idx), engine.prefill_rows)]

def admit(engine, params, state, requests, rng, sps, blocks, prefixes, admitted):
    """Starts `admitted` = [(slot, request, sample)]: prefills the blocks of requests not
    yet prefilled, then inserts one call per prefix block."""
    for i in sorted({i for _, i, _ in admitted}):
        if i in prefixes:
            continue
        block = blocks[i]
        prefix = engine.prefill_many(params, [requests[j].tokens for j in block],
                                   rows=engine.prefill_rows)
        prefixes.update({j: (prefix, row) for row, j in enumerate(block)})
    keys = request_key_data(
        rng, [i if requests[i].seed is None else requests[i].seed for _, i, _ in admitted],
        [g for _, _, g in admitted], pad_to=engine.max_slots)
    calls: dict[int, tuple[Prefix, list]] = {}
    for (slot, i, _), key in zip(admitted, keys, strict=True):
        prefix, row = prefixes[i]
        calls.setdefault(id(prefix), (prefix, []))[1].append((slot, row, key, sps[i]))
    for prefix, entries in calls.values():
        state = engine.insert_many(prefix, state, entries, pad_to=engine.max_slots)
    return state

def generate_groups(
    engine,
    requests: Sequence[Request],
    *,
    n_samples: int = 1,
    rng: jax.Array | None = None,
    params: dict | None = None,
    admission: str = "fifo",
    predictor: scheduling.LengthPredictor | None = None,
    on_group: Callable[[GenerationGroup], None] | None = None,
    stop: Callable[[], bool] | None = None,
    sampling: SamplingConfig | None = None,
) -> list[GenerationGroup]:
    """Samples every request's responses with continuous batching; groups in request order.

    admission: "fifo" or "longest_first" (by `predictor.predict(prompt_id)`). `on_group` is
    called with each group as soon as its last sample finishes (completion order), e.g. to
    start scoring it while decoding goes on. `sampling` overrides the engine's for this call
    (no recompilation). `stop` is polled at every sync: when it returns True the samples in
    flight are abandoned and only the groups already complete are returned (in request
    order; `last_stats["engine/abandoned_samples"]` counts the rest). Figures of the run go
    to `engine.last_stats`.
    """
    params = engine.params if params is None else params
    if params is None:
        raise ValueError("Engine has no weights: pass params or call load_params first")
    if admission == "longest_first" and predictor is None:
        raise ValueError("admission='longest_first' needs a LengthPredictor")
    sampling = sampling or engine.sampling
    check_requests(engine, requests, n_samples, sampling)
    sps = [
        engine.slot_sampling(
            dataclasses.replace(
                sampling, max_new_tokens=r.max_new_tokens or sampling.max_new_tokens
            )
        )
        for r in requests
    ]
    rng = jax.random.key(0) if rng is None else rng
    predicted = [predictor.predict(r.prompt_id) if predictor else 0.0 for r in requests]
    queue = [
        (i, g)
        for i in scheduling.admission_order(predicted, admission)
        for g in range(requests[i].n_samples or n_samples)
    ]
    queue.reverse()  # pop() from the end
    start = time.perf_counter()
    state = engine.init_decode_state()
    owner: list[tuple[int, int] | None] = [None] * engine.max_slots
    blocks = {i: block for block in prefill_blocks(engine, requests) for i in block}
    prefixes: dict[int, tuple[Prefix, int]] = {}
    pending: dict[int, dict[int, Generation]] = {}
    groups: dict[int, GenerationGroup] = {}
    syncs = generated = 0
    stopped = False
    while queue or any(o is not None for o in owner):
        if engine.stop_requested or (stop is not None and stop()):
            stopped = True
            break
        admitted = []
        for slot in range(engine.max_slots):
            if owner[slot] is None and queue:
                owner[slot] = queue.pop()
                admitted.append(slot)
        if admitted:
            state = admit(engine, params, state, requests, rng, sps, blocks, prefixes,
                                [(slot, *owner[slot]) for slot in admitted])
        state, _ = engine.generate(params, state)
        syncs += 1
        phase = np.asarray(state.phase_B)
        finished = [slot for slot in np.flatnonzero(phase == DONE) if owner[slot] is not None]
        host = jax.device_get((state.pos_B, state.prompt_len_B, state.tokens_BxS,
                               state.logprobs_BxS, state.experts_BxSxMxk)) if finished else None
        for slot in finished:
            (i, g), owner[slot] = owner[slot], None
            gen, n = collect(host, slot, sampling.stop_tokens)
            generated += n
            pending.setdefault(i, {})[g] = gen
            want = requests[i].n_samples or n_samples
            if len(pending[i]) == want:
                r = requests[i]
                done = pending.pop(i)
                prefixes.pop(i, None)
                groups[i] = GenerationGroup(
                    i,
                    r.prompt_id,
                    np.asarray(r.tokens, np.int32),
                    [done[k] for k in range(want)],
                )
                if on_group is not None:
                    on_group(groups[i])
    wall = time.perf_counter() - start
    slot_steps = syncs * engine.steps_per_sync * engine.max_slots
    busy = int(state.busy_steps)
    engine.last_stats = {
        "engine/wall_s": wall,
        "engine/generated_tokens": float(generated),
        "engine/tokens_per_s": generated / wall if wall > 0 else 0.0,
        "engine/decode_steps": float(syncs * engine.steps_per_sync),
        "engine/idle_slot_frac": 1.0 - busy / slot_steps if slot_steps else 0.0,
        "engine/abandoned_samples": float(
            sum(o is not None for o in owner) + len(queue) + sum(map(len, pending.values()))
        )
        if stopped
        else 0.0,
    }
    return [groups[i] for i in range(len(requests)) if i in groups]


# ---- shards: independent slot groups, one host thread each ---------------------------------------
def shard_requests(requests: Sequence[Request], n_shards: int, n_samples: int,
                   sampling: SamplingConfig) -> list[list[int]]:
    """Request indices per shard: whole requests (a group's samples stay together, sharing one
    prefill), balanced by their token budget (samples x max_new_tokens, longest first to the
    least loaded shard: `scheduling.balance_lpt`), each shard's in request order. Depends on the
    request list alone, never on admission or length predictions."""
    work = [(r.n_samples or n_samples) * (r.max_new_tokens or sampling.max_new_tokens)
            for r in requests]
    return [sorted(idx) for idx in scheduling.balance_lpt(work, n_shards)]


def generate_sharded(shards: Sequence, requests: Sequence[Request], *, n_samples: int = 1,
                     rng: jax.Array | None = None, params: dict | None = None,
                     on_group: Callable[[GenerationGroup], None] | None = None,
                     stop: Callable[[], bool] | None = None,
                     sampling: SamplingConfig | None = None, **kwargs
                     ) -> tuple[list[GenerationGroup], dict[str, float]]:
    """`generate_groups` over several engines at once, each with its own slots, driven by its
    own host thread (`shard_requests` splits the requests). On a CPU, XLA runs a decode step's
    many small ops one after another; two shards keep two cores busy (bench peers' generation
    on a 2-core AMD EPYC: 289 -> 175-213 ms). A request keeps its RNG stream (`Request.seed`,
    default its index in `requests`), groups come back in request order with their
    `request_index` in `requests`, and `on_group` is called under a lock (one group at a time).
    A shard that fails stops the others at their next sync, and its error is raised.
    `kwargs`: the rest of `generate_groups`' arguments, passed to every shard. Returns the
    groups and the run's `last_stats` (over all shards)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 (only sharded engines)

    sampling = sampling or shards[0].sampling
    check_requests(shards[0], requests, n_samples, sampling)
    parts = shard_requests(requests, len(shards), n_samples, sampling)
    lock, failed = threading.Lock(), threading.Event()
    halt = lambda: failed.is_set() or (stop is not None and stop())
    start = time.perf_counter()

    def run(engine, idx: list[int]) -> list[GenerationGroup]:
        if not idx:
            engine.last_stats = {}
            return []
        local = [dataclasses.replace(requests[i], seed=i if requests[i].seed is None
                                     else requests[i].seed) for i in idx]

        def relay(group: GenerationGroup) -> None:
            with lock:
                on_group(dataclasses.replace(group, request_index=idx[group.request_index]))

        try:
            groups = generate_groups(engine, local, n_samples=n_samples, rng=rng, params=params,
                                     on_group=relay if on_group else None, stop=halt,
                                     sampling=sampling, **kwargs)
        except BaseException:
            failed.set()
            raise
        return [dataclasses.replace(g, request_index=idx[g.request_index]) for g in groups]

    with ThreadPoolExecutor(len(shards), thread_name_prefix="engine-shard") as pool:
        futures = [pool.submit(run, e, idx) for e, idx in zip(shards, parts, strict=True)]
        results = [f.result() for f in futures]
    wall = time.perf_counter() - start
    stats = [e.last_stats for e in shards if e.last_stats]
    total = lambda key: sum(s[key] for s in stats)
    generated = total("engine/generated_tokens")
    slots = shards[0].max_slots  # every shard's
    slot_steps = slots * total("engine/decode_steps")
    busy = slots * sum((1 - s["engine/idle_slot_frac"]) * s["engine/decode_steps"] for s in stats)
    shards_stats = {
        "engine/wall_s": wall,
        "engine/generated_tokens": generated,
        "engine/tokens_per_s": generated / wall if wall > 0 else 0.0,
        "engine/decode_steps": max((s["engine/decode_steps"] for s in stats), default=0.0),
        "engine/idle_slot_frac": 1.0 - busy / slot_steps if slot_steps else 0.0,
        "engine/abandoned_samples": total("engine/abandoned_samples"),
    }
    return sorted((g for r in results for g in r), key=lambda g: g.request_index), shards_stats
