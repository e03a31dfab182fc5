"""The embedded JAX rollout engine: KV-cache generation with routing capture.

Shaped like JetStream's `Engine`: `prefill(params, prompt_tokens) -> Prefix` runs a prompt once;
`insert(prefix, decode_state, slot, key)` copies it into one of `max_slots` fixed decode slots
(and draws the first token); `generate(params, decode_state) -> (decode_state, tokens)` advances
every active slot by `steps_per_sync` tokens in one jit-compiled call with static shapes
([max_slots, max_cache_len]). `generate_groups` drives them with continuous batching: a slot that
finishes takes the next sample at once; the G samples of a prompt share one prefill.

What is recorded, per response: the sampled tokens; the log-prob of each under the distribution
it was drawn from (see `espo_jax.rollout.sampling`); and the experts every MoE layer routed each
prompt and response token to, int16 `[prompt + response, M, k]`. The last sampled token was
never fed forward, so its row holds the sentinel -1: its routing could only influence logits
after the end of the response, which no one computes (`espo_jax.rollout.records` contract).

Determinism: sample g of request i draws its t-th token with key fold_in(fold_in(fold_in(rng,
seed_i), g), t), seed_i = `Request.seed` or i. Nothing depends on which slot ran it or when, so
FIFO and length-aware admission give the same groups, returned in request order.

Precision: "fp32", "bf16" (compute and weights), or "fp8" (E4M3 weights with per-channel scales
from `espo_jax.models.quant`, dequantised on the fly; router and LM head stay fp32). MoE dispatch
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
    ):
        if max_slots < 1 or steps_per_sync < 1:
            raise ValueError(
                f"max_slots ({max_slots}) and steps_per_sync ({steps_per_sync}) must be >= 1"
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
        self.params = jax.device_put(engine_params(params, self.config, self.precision)[0])

    # -- JetStream-shaped API --------------------------------------------------------------------
    def prefill_len(self, n: int) -> int:
        """Padded prompt length: a power of two >= n (at least min_prefill_len), <= S."""
        return min(self.max_cache_len, max(self.min_prefill_len, 1 << max(0, n - 1).bit_length()))

    def prefill(self, params: dict, prompt_tokens: Sequence[int]) -> Prefix:
        n = len(prompt_tokens)
        p = self.prefill_len(n)
        tokens = np.zeros((1, p), np.int32)
        tokens[0, :n] = prompt_tokens
        return prefill_jit(self.config, params, jnp.asarray(tokens), jnp.int32(n))

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
        """`sampling` as the arrays `insert` takes; checks it fits this engine."""
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
            jnp.float32(sampling.temperature),
            jnp.int32(sampling.top_k),
            jnp.float32(sampling.top_p),
            jnp.int32(sampling.max_new_tokens),
            jnp.asarray(stop),
        )

    def insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slot: int,
        key: jax.Array,
        sampling: SamplingConfig | SlotSampling | None = None,
    ) -> DecodeState:
        """Starts a sample of `prefix` in `slot` (drawing its first token with `key`)."""
        sp = (
            sampling
            if isinstance(sampling, SlotSampling)
            else self.slot_sampling(sampling or self.sampling)
        )
        return insert_jit(prefix, decode_state, jnp.int32(slot), key, sp)

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

    def _collect(self, state: DecodeState, slot: int, stop_tokens) -> tuple[Generation, int]:
        pos, n = (int(x) for x in jax.device_get((state.pos_B[slot], state.prompt_len_B[slot])))
        tokens, logprobs, experts = jax.device_get(
            (
                state.tokens_BxS[slot, n : pos + 1],
                state.logprobs_BxS[slot, n : pos + 1],
                state.experts_BxSxMxk[slot, : pos + 1],
            )
        )
        stopped = int(tokens[-1]) in stop_tokens
        routed = np.asarray(experts, np.int16) if self.config.n_moe_layers else None
        gen = Generation(
            np.asarray(tokens, np.int32),
            np.asarray(logprobs, np.float32),
            routed,
            "stop" if stopped else "length",
        )
        return gen, len(tokens)

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
        prefixes: dict[int, Prefix] = {}
        pending: dict[int, dict[int, Generation]] = {}
        groups: dict[int, GenerationGroup] = {}
        syncs = generated = 0
        stopped = False
        while queue or any(o is not None for o in owner):
            if self._stop.is_set() or (stop is not None and stop()):
                stopped = True
                break
            for slot in range(self.max_slots):
                if owner[slot] is None and queue:
                    i, g = queue.pop()
                    r = requests[i]
                    if i not in prefixes:
                        prefixes[i] = self.prefill(params, r.tokens)
                    seed = i if r.seed is None else r.seed
                    state = self.insert(prefixes[i], state, slot, request_key(rng, seed, g), sps[i])
                    owner[slot] = (i, g)
            state, _ = self.generate(params, state)
            syncs += 1
            phase = np.asarray(state.phase_B)
            for slot in np.flatnonzero(phase == DONE):
                if owner[slot] is None:
                    continue
                (i, g), owner[slot] = owner[slot], None
                gen, n = self._collect(state, slot, sampling.stop_tokens)
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
