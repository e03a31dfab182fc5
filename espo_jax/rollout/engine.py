"""The embedded JAX rollout engine: KV-cache generation with routing capture.

Shaped like JetStream's `Engine`: `prefill(params, prompt_tokens) -> Prefix` runs a prompt once;
`insert(prefix, decode_state, slot, key)` copies it into one of `max_slots` fixed decode slots
(and draws the first token); `generate(params, decode_state) -> (decode_state, tokens)` advances
every active slot by `steps_per_sync` tokens in one jit-compiled call with static shapes
([max_slots, max_cache_len]). `generate_groups` drives them with continuous batching: a slot that
finishes takes the next sample at once; the G samples of a prompt share one prefill. It prefills
`prefill_rows` prompts per call (`prefill_many`; blocks fixed by the request list), inserts every
sample admitted at a sync that shares a prefix block in one call (`insert_many`), and reads all
slots finished at a sync in one transfer: per-prompt / per-slot calls cost 6.5 / 1 / 1.4 ms each
on the 2-core CPU, 40% of a 1024-sample run (13.5 s -> 8.6 s).

What is recorded, per response: the sampled tokens; the log-prob of each under the distribution
it was drawn from (see `espo_jax.rollout.sampling`); and the experts every MoE layer routed each
prompt and response token to, int16 `[prompt + response, M, k]`. The last sampled token was
never fed forward, so its row holds the sentinel -1: its routing could only influence logits
after the end of the response, which no one computes (`espo_jax.buffer.records` contract).

Determinism: sample g of request i draws its t-th token with key fold_in(fold_in(fold_in(rng,
seed_i), g), t), seed_i = `Request.seed` or i. Nothing depends on which slot ran it or when, so
FIFO and length-aware admission give the same groups, returned in request order.

Precision: "fp32", "bf16" (compute and weights), or "fp8" (E4M3 weights with per-channel scales
from `espo_jax.models.quant`; router and LM head stay fp32). FP8 weights are dequantised once per
`load_params` (the values every forward would compute; `fp8_storage=True` keeps them as E4M3 and
dequantises in every forward instead, a quarter of the weight memory). MoE dispatch
is always exact (a "capacity" config is switched to "dropless": dropping tokens would make a
sample depend on its batch neighbours). The jit-compiled pieces are in
`espo_jax.rollout.decode`; this module holds the `Engine` and its continuous-batching driver.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax import models
from espo_jax.models import quant
from espo_jax.models.config import ModelConfig
from espo_jax.rollout import scheduling
from espo_jax.rollout.decode import (  # noqa: F401  (re-exported: the engine's public types)
    DONE,
    PRECISIONS,
    DecodeState,
    Prefix,
    SlotSampling,
    engine_params,
    generate_jit,
    insert_jit,
    prefill_jit,
)
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


# ---- the engine ---------------------------------------------------------------------------------
class Engine:
    """Fixed-slot generation engine; see module doc. `params` are the learner's (float) params."""

    def __init__(
        self,
        config: ModelConfig,
        params: dict | None = None,
        *,
        sampling: SamplingConfig | None = None,
        max_slots: int = 8,
        max_cache_len: int = 256,
        precision: str = "fp32",
        steps_per_sync: int = 4,
        min_prefill_len: int = 16,
        max_stop_tokens: int = 8,
        prefill_rows: int = 16,
        fp8_storage: bool = False,
    ):
        if min(max_slots, steps_per_sync, prefill_rows) < 1:
            raise ValueError(
                f"max_slots ({max_slots}), steps_per_sync ({steps_per_sync}) and prefill_rows "
                f"({prefill_rows}) must be >= 1"
            )
        if max_cache_len < 2:
            raise ValueError(f"max_cache_len must be >= 2, got {max_cache_len}")
        sampling = SamplingConfig() if sampling is None else sampling
        self.precision = precision
        _, self.config = engine_params({}, config, precision)
        self.max_stop_tokens = max_stop_tokens
        self.sampling = sampling
        self.max_slots, self.max_cache_len = max_slots, max_cache_len
        self.slot_sampling(sampling)  # validates it against this engine
        self.steps_per_sync, self.min_prefill_len = steps_per_sync, min_prefill_len
        self.prefill_rows = prefill_rows  # prompts per prefill call (a fixed shape)
        # fp8: keep the weights as E4M3 (1 byte each, dequantised in every forward) instead of
        # dequantising them once per load (4 bytes each; same samples, faster here).
        self.fp8_storage = fp8_storage
        self.params: dict | None = None
        self.last_stats: dict[str, float] = {}
        self._stop = threading.Event()
        if params is not None:
            self.load_params(params)

    def request_stop(self) -> None:
        """Makes `generate_groups` (now or later) return at its next sync with only the groups
        already complete (safe from a signal handler or another thread); see `clear_stop`."""
        self._stop.set()

    def clear_stop(self) -> None:
        self._stop.clear()

    @property
    def sampler_name(self) -> str:
        return f"jax-{self.precision}"

    def load_params(self, params: dict) -> None:
        """Installs new (learner, float) weights, converted to the engine's precision and
        placed on the device once (host numpy arrays, e.g. from `weights.load`, would otherwise
        be transferred at every decode call)."""
        converted = engine_params(params, self.config, self.precision)[0]
        if self.precision == "fp8" and not self.fp8_storage:
            # E4M3 values times their scales, computed once here instead of in every forward:
            # the matmuls see the same numbers (samples bitwise equal), decoding is ~11% faster
            # on the CPU, and the fp8 and fp32 engines share compiled code.
            converted = quant.dequantize_params(converted, jnp.float32)
        self.params = jax.device_put(converted)

    # -- JetStream-shaped API --------------------------------------------------------------------
    def prefill_len(self, n: int) -> int:
        """Padded prompt length: a power of two >= n (at least min_prefill_len), <= S."""
        return min(self.max_cache_len, max(self.min_prefill_len, 1 << max(0, n - 1).bit_length()))

    def prefill(self, params: dict, prompt_tokens: Sequence[int]) -> Prefix:
        """One prompt: a `Prefix` of one row."""
        return self.prefill_many(params, [prompt_tokens], rows=1)

    def prefill_many(self, params: dict, prompts: Sequence[Sequence[int]], rows: int) -> Prefix:
        """Prompts of one padded length in one call, as `rows` rows (extra rows are padding:
        a fixed row count compiles once per padded length)."""
        p = self.prefill_len(max(len(t) for t in prompts))
        if len(prompts) > rows or any(self.prefill_len(len(t)) != p for t in prompts):
            raise ValueError(f"prefill_many takes at most {rows} prompts of one padded length")
        tokens = np.zeros((rows, p), np.int32)
        lengths = np.ones((rows,), np.int32)
        for r, t in enumerate(prompts):
            tokens[r, : len(t)] = t
            lengths[r] = len(t)
        return prefill_jit(self.config, params, jnp.asarray(tokens), jnp.asarray(lengths))

    def init_decode_state(self) -> DecodeState:
        c, b, s = self.config, self.max_slots, self.max_cache_len
        zeros = lambda dt: jnp.zeros((b,), dt)
        return DecodeState(
            cache=models.init_cache(c, b, s),
            cache_mask_BxS=jnp.zeros((b, s), bool),
            tokens_BxS=jnp.zeros((b, s), jnp.int32),
            logprobs_BxS=jnp.zeros((b, s), jnp.float32),
            experts_BxSxMxk=jnp.full((b, s, c.n_moe_layers, c.top_k), -1, jnp.int16),
            pos_B=zeros(jnp.int32),
            prompt_len_B=zeros(jnp.int32),
            phase_B=zeros(jnp.int32),
            keys_B=jax.random.split(jax.random.key(0), b),
            temperature_B=zeros(jnp.float32),
            top_k_B=zeros(jnp.int32),
            top_p_B=jnp.ones((b,), jnp.float32),
            max_new_B=zeros(jnp.int32),
            stop_BxN=jnp.full((b, self.max_stop_tokens), -1, jnp.int32),
            busy_steps=jnp.zeros((), jnp.int32),
        )

    def slot_sampling(self, sampling: SamplingConfig) -> SlotSampling:
        """`sampling` as the (host) arrays `insert` takes; checks it fits this engine."""
        if sampling.max_new_tokens >= self.max_cache_len:
            raise ValueError(
                f"max_new_tokens ({sampling.max_new_tokens}) must be < max_cache_len "
                f"({self.max_cache_len}), which also holds the prompt"
            )
        if len(sampling.stop_tokens) > self.max_stop_tokens:
            raise ValueError(
                f"{len(sampling.stop_tokens)} stop tokens; this engine takes at most "
                f"max_stop_tokens={self.max_stop_tokens}"
            )
        stop = np.full((self.max_stop_tokens,), -1, np.int32)
        stop[: len(sampling.stop_tokens)] = sampling.stop_tokens
        return SlotSampling(
            np.float32(sampling.temperature),
            np.int32(sampling.top_k),
            np.float32(sampling.top_p),
            np.int32(sampling.max_new_tokens),
            stop,
        )

    def insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slot: int,
        key: jax.Array,
        sampling: SamplingConfig | SlotSampling | None = None,
    ) -> DecodeState:
        """Starts a sample of `prefix` (its first row) in `slot`, drawing its first token with
        `key`."""
        sp = (
            sampling
            if isinstance(sampling, SlotSampling)
            else self.slot_sampling(sampling or self.sampling)
        )
        return self.insert_many(prefix, decode_state, [(slot, 0, key, sp)], pad_to=1)

    def insert_many(self, prefix: Prefix, decode_state: DecodeState, entries, pad_to: int
                    ) -> DecodeState:
        """One call for `entries` = [(slot, prefix row, key, SlotSampling)], padded to `pad_to`
        entries (a fixed count compiles once per prefix shape)."""
        pad = pad_to - len(entries)
        if not entries or pad < 0:
            raise ValueError(f"insert_many takes 1..{pad_to} entries, got {len(entries)}")
        slots = np.array([e[0] for e in entries] + [self.max_slots] * pad, np.int32)
        rows = np.array([e[1] for e in entries] + [0] * pad, np.int32)
        keys = jnp.stack([e[2] for e in entries] + [entries[0][2]] * pad)
        sps = [e[3] for e in entries] + [entries[0][3]] * pad
        sp = SlotSampling(*(np.stack([np.asarray(getattr(x, f.name)) for x in sps])
                            for f in dataclasses.fields(SlotSampling)))
        return insert_jit(prefix, decode_state, jnp.asarray(slots), jnp.asarray(rows), keys, sp)

    def generate(self, params: dict, decode_state: DecodeState) -> tuple[DecodeState, jax.Array]:
        """`steps_per_sync` decode steps; tokens [steps, B] sampled (-1 where a slot was idle)."""
        return generate_jit(self.config, self.steps_per_sync, params, decode_state)

    # -- driver ------------------------------------------------------------------------------
    def _check(self, requests: Sequence[Request], n_samples: int, sampling) -> None:
        for i, r in enumerate(requests):
            max_new = r.max_new_tokens or sampling.max_new_tokens
            limit = self.max_cache_len - max_new
            if not 1 <= len(r.tokens) <= limit:
                raise ValueError(
                    f"request {i} (prompt {r.prompt_id!r}) has {len(r.tokens)} prompt tokens; "
                    f"need 1..{limit} (max_cache_len {self.max_cache_len} - max_new_tokens "
                    f"{max_new})"
                )
            if (r.n_samples or n_samples) < 1:
                raise ValueError(f"request {i}: n_samples must be >= 1")
            bad = [t for t in r.tokens if not 0 <= int(t) < self.config.vocab_size]
            if bad:
                raise ValueError(
                    f"request {i}: token ids {bad[:5]} outside the vocabulary "
                    f"[0, {self.config.vocab_size})"
                )

    @staticmethod
    def _collect(host: tuple, slot: int, stop_tokens) -> tuple[Generation, int]:
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

    def _prefill_blocks(self, requests: Sequence[Request]) -> list[list[int]]:
        """The request list cut into prefill calls: requests of one padded length, in index
        order, `prefill_rows` at a time. A prompt's prefix depends on its block (batched float
        sums), so blocks are fixed by the request list alone, never by admission timing."""
        by_len: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_len.setdefault(self.prefill_len(len(r.tokens)), []).append(i)
        return [idx[c : c + self.prefill_rows] for _, idx in sorted(by_len.items())
                for c in range(0, len(idx), self.prefill_rows)]

    def _admit(self, params, state, requests, rng, sps, blocks, prefixes, admitted):
        """Starts `admitted` = [(slot, request, sample)]: prefills the blocks of requests not
        yet prefilled, then inserts one call per prefix block."""
        for i in sorted({i for _, i, _ in admitted}):
            if i in prefixes:
                continue
            block = blocks[i]
            prefix = self.prefill_many(params, [requests[j].tokens for j in block],
                                       rows=self.prefill_rows)
            prefixes.update({j: (prefix, row) for row, j in enumerate(block)})
        calls: dict[int, tuple[Prefix, list]] = {}
        for slot, i, g in admitted:
            prefix, row = prefixes[i]
            seed = i if requests[i].seed is None else requests[i].seed
            calls.setdefault(id(prefix), (prefix, []))[1].append(
                (slot, row, request_key(rng, seed, g), sps[i]))
        for prefix, entries in calls.values():
            state = self.insert_many(prefix, state, entries, pad_to=self.max_slots)
        return state

    def generate_groups(
        self,
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
        to `self.last_stats`.
        """
        params = self.params if params is None else params
        if params is None:
            raise ValueError("Engine has no weights: pass params or call load_params first")
        if admission == "longest_first" and predictor is None:
            raise ValueError("admission='longest_first' needs a LengthPredictor")
        sampling = sampling or self.sampling
        self._check(requests, n_samples, sampling)
        sps = [
            self.slot_sampling(
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
        state = self.init_decode_state()
        owner: list[tuple[int, int] | None] = [None] * self.max_slots
        blocks = {i: block for block in self._prefill_blocks(requests) for i in block}
        prefixes: dict[int, tuple[Prefix, int]] = {}
        pending: dict[int, dict[int, Generation]] = {}
        groups: dict[int, GenerationGroup] = {}
        syncs = generated = 0
        stopped = False
        while queue or any(o is not None for o in owner):
            if self._stop.is_set() or (stop is not None and stop()):
                stopped = True
                break
            admitted = []
            for slot in range(self.max_slots):
                if owner[slot] is None and queue:
                    owner[slot] = queue.pop()
                    admitted.append(slot)
            if admitted:
                state = self._admit(params, state, requests, rng, sps, blocks, prefixes,
                                    [(slot, *owner[slot]) for slot in admitted])
            state, _ = self.generate(params, state)
            syncs += 1
            phase = np.asarray(state.phase_B)
            finished = [slot for slot in np.flatnonzero(phase == DONE) if owner[slot] is not None]
            host = jax.device_get((state.pos_B, state.prompt_len_B, state.tokens_BxS,
                                   state.logprobs_BxS, state.experts_BxSxMxk)) if finished else None
            for slot in finished:
                (i, g), owner[slot] = owner[slot], None
                gen, n = self._collect(host, slot, sampling.stop_tokens)
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
        slot_steps = syncs * self.steps_per_sync * self.max_slots
        busy = int(state.busy_steps)
        self.last_stats = {
            "engine/wall_s": wall,
            "engine/generated_tokens": float(generated),
            "engine/tokens_per_s": generated / wall if wall > 0 else 0.0,
            "engine/decode_steps": float(syncs * self.steps_per_sync),
            "engine/idle_slot_frac": 1.0 - busy / slot_steps if slot_steps else 0.0,
            "engine/abandoned_samples": float(
                sum(o is not None for o in owner) + len(queue) + sum(map(len, pending.values()))
            )
            if stopped
            else 0.0,
        }
        return [groups[i] for i in range(len(requests)) if i in groups]
