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
on the 2-core CPU, 40% of a 1024-sample run (13.5 s -> 8.6 s). With `shards` > 1 the slots
form that many independent groups, each driven by its own host thread (`batching.
generate_sharded`): on a CPU, XLA runs a decode step's many small ops one after another, so one
slot group keeps one core busy and two keep two.

What is recorded, per response: the sampled tokens; the log-prob of each under the distribution
it was drawn from (see `espo_jax.rollout.sampling`); and the experts every MoE layer routed each
prompt and response token to, int16 `[prompt + response, M, k]`. The last sampled token was
never fed forward, so its row holds the sentinel -1: its routing could only influence logits
after the end of the response, which no one computes (`espo_jax.buffer.records` contract).

Determinism: sample g of request i draws its t-th token with key fold_in(fold_in(fold_in(rng,
seed_i), g), t), seed_i = `Request.seed` or i. Nothing depends on which slot ran it or when, so
FIFO and length-aware admission give the same groups, returned in request order.

Precision: "fp32", "bf16" (compute and weights), "fp8" (E4M3 weights with per-channel scales
from `espo_jax.models.quant`) or "fp8_block" (E4M3 with 128x128 block scales, as DeepSeek-V3's
checkpoints); with either FP8 the router and LM head stay fp32. FP8 weights are dequantised
once per `load_params` (the values every forward would compute; `fp8_storage=True` keeps them
as E4M3 and dequantises in every forward instead, a quarter of the weight memory). MoE dispatch
is always exact (a "capacity" config is switched to "dropless_loop": dropping tokens would make a
sample depend on its batch neighbours). The jit-compiled pieces are in
`espo_jax.rollout.decode`, the continuous-batching driver in `espo_jax.rollout.batching`; this
module holds the `Engine`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax.models import quant
from espo_jax.models.config import ModelConfig
from espo_jax.rollout import batching
from espo_jax.rollout.batching import (  # noqa: F401  (re-exported)
    Generation,
    GenerationGroup,
    Request,
    request_key,
)
from espo_jax.rollout.decode import (  # noqa: F401  (re-exported: the engine's public types)
    DONE,
    FP8_SCHEMES,
    DecodeState,
    Prefix,
    SlotSampling,
    engine_params,
    generate_jit,
    init_state_jit,
    insert_jit,
    prefill_jit,
)
from espo_jax.rollout.sampling import SamplingConfig


# ---- the engine ---------------------------------------------------------------------------------
def auto_shards(max_slots: int) -> int:
    """Slot groups for `Engine(shards=0)`: 1 on an accelerator (it runs a step's ops in
    parallel); on a CPU one per core, at most 2 (measured on 2 cores: one group keeps one core
    busy, four ran slower than two; more cores untested), a divisor of `max_slots`."""
    if jax.default_backend() != "cpu":
        return 1
    n = max(1, min(2, os.cpu_count() or 1, max_slots))
    while max_slots % n:
        n -= 1
    return n


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
        shards: int = 1,
    ):
        if min(max_slots, steps_per_sync, prefill_rows) < 1 or shards < 0:
            raise ValueError(
                f"max_slots ({max_slots}), steps_per_sync ({steps_per_sync}) and prefill_rows "
                f"({prefill_rows}) must be >= 1, shards ({shards}) >= 0 (0: `auto_shards`)"
            )
        shards = shards or auto_shards(max_slots)
        if max_slots % shards:
            raise ValueError(f"max_slots ({max_slots}) must be a multiple of shards ({shards}): "
                             f"each shard holds max_slots / shards decode slots")
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
        # `generate_groups` over `shards` engines of max_slots / shards slots each, one host
        # thread each (see `batching.generate_sharded`); the JetStream-shaped calls below act
        # on this engine's own max_slots slots.
        self.shards = shards
        self._shard_engines: list[Engine] = []
        self.params: dict | None = None
        self.last_stats: dict[str, float] = {}
        self._stop = threading.Event()
        if params is not None:
            self.load_params(params)

    def request_stop(self) -> None:
        """Makes `generate_groups` (now or later) return at its next sync with only the groups
        already complete (safe from a signal handler or another thread); a stopped engine stays
        stopped."""
        self._stop.set()

    @property
    def sampler_name(self) -> str:
        return f"jax-{self.precision}"

    def load_params(self, params: dict) -> None:
        """Installs new (learner, float) weights, converted to the engine's precision and
        placed on the device once (host numpy arrays, e.g. from `weights.load`, would otherwise
        be transferred at every decode call), committed where they lie: host weights first,
        a learner's (committed) arrays after an update, then share the compiled decode code
        (jit keys on committedness: an uncommitted first load cost a recompile of prefill,
        insert and decode at the second)."""
        converted = engine_params(params, self.config, self.precision)[0]
        if self.precision in FP8_SCHEMES and not self.fp8_storage:
            # E4M3 values times their scales, computed once here instead of in every forward:
            # the matmuls see the same numbers (samples bitwise equal), decoding is ~11% faster
            # on the CPU, and the fp8 and fp32 engines share compiled code.
            converted = quant.dequantize_params(converted, jnp.float32)
        placed = jax.device_put(converted)
        self.params = jax.tree.map(
            lambda x: x if x.committed else jax.device_put(x, x.sharding), placed)

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
        """Every slot free (one compiled call: built op by op it cost more host time than the
        decode steps of a short rollout)."""
        return init_state_jit(self.config, self.max_slots, self.max_cache_len,
                              self.max_stop_tokens)

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
        entries (a fixed count compiles once per prefix shape). Keys are PRNG keys, or all raw
        key data on the host (`batching.request_key_data` rows), stacked without a dispatch."""
        pad = pad_to - len(entries)
        if not entries or pad < 0:
            raise ValueError(f"insert_many takes 1..{pad_to} entries, got {len(entries)}")
        slots = np.array([e[0] for e in entries] + [self.max_slots] * pad, np.int32)
        rows = np.array([e[1] for e in entries] + [0] * pad, np.int32)
        keys = [e[2] for e in entries] + [entries[0][2]] * pad
        if all(isinstance(k, np.ndarray) for k in keys):
            keys = jax.random.wrap_key_data(np.stack(keys))
        else:
            keys = jnp.stack(keys)
        sps = [e[3] for e in entries] + [entries[0][3]] * pad
        sp = SlotSampling(*(np.stack([np.asarray(getattr(x, f.name)) for x in sps])
                            for f in dataclasses.fields(SlotSampling)))
        return insert_jit(self.config, prefix, decode_state, jnp.asarray(slots),
                          jnp.asarray(rows), keys, sp)

    def generate(self, params: dict, decode_state: DecodeState) -> tuple[DecodeState, jax.Array]:
        """`steps_per_sync` decode steps; tokens [steps, B] sampled (-1 where a slot was idle)."""
        return generate_jit(self.config, self.steps_per_sync, params, decode_state)


    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def generate_groups(self, requests: Sequence[Request], **kwargs) -> list[GenerationGroup]:
        """Samples every request's responses with continuous batching, groups in request order:
        `espo_jax.rollout.batching.generate_groups(self, requests, **kwargs)` (its arguments:
        n_samples, rng, params, admission, predictor, on_group, stop, sampling). With
        `shards` > 1 the requests are split over that many engines of max_slots / shards slots,
        each driven by its own thread (`batching.generate_sharded`): a sample then depends on
        the request list and the shard count, still not on admission or timing."""
        if self.shards == 1:
            return batching.generate_groups(self, requests, **kwargs)
        # This engine's weights and sampling at this call (each shard checks there are weights).
        if kwargs.get("params") is None:
            kwargs["params"] = self.params
        kwargs["sampling"] = kwargs.get("sampling") or self.sampling
        groups, self.last_stats = batching.generate_sharded(self._shards(), requests, **kwargs)
        return groups

    def _shards(self) -> list[Engine]:
        """The shard engines (made once; they share this engine's weights at each call and
        its stop request)."""
        if not self._shard_engines:
            for _ in range(self.shards):
                shard = Engine(self.config, sampling=self.sampling,
                               max_slots=self.max_slots // self.shards,
                               max_cache_len=self.max_cache_len, precision=self.precision,
                               steps_per_sync=self.steps_per_sync,
                               min_prefill_len=self.min_prefill_len,
                               max_stop_tokens=self.max_stop_tokens,
                               prefill_rows=self.prefill_rows, fp8_storage=self.fp8_storage)
                shard._stop = self._stop
                self._shard_engines.append(shard)
        return self._shard_engines
