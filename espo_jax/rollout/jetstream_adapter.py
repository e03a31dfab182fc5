"""The embedded JAX engine behind JetStream's `Engine` API (google-jetstream 0.2.2).

`JetStreamEngine(engine)` implements `jetstream.engine.engine_api.Engine` on top of
`espo_jax.rollout.engine.Engine`, whose prefill / insert / generate already have JetStream's
shape. What the adapter adds:
- `prefill(padded_tokens, true_length)` -> the engine's prefill of the unpadded prompt.
- `insert(prefix, decode_state, slot)`: JetStream passes no RNG key; the n-th insert samples with
  `request_key(rng, n, 0)`, i.e. exactly as `Engine.generate_groups` samples request seed n,
  sample 0 (same tokens, same log-probs).
- `generate`: the engine draws a slot's first token at insert and then `steps_per_sync` tokens
  per call; JetStream reads a fixed number of tokens per slot per call (`ResultTokens` columns,
  its "speculations") and ends a sample at the first invalid column. So every call reports, per
  slot, the `steps_per_sync` oldest tokens not reported yet (one token lags behind while the slot
  runs), and a finished slot reports its remaining tokens and then an invalid column.
- `generation(decode_state, slot)`: the record side JetStream has no place for, the sampled
  tokens' behaviour log-probs and routed experts (`engine.Generation`), read before the slot is
  reused.

Only the Engine API is offered. JetStream's own server loop (`jetstream.core.orchestrator`)
calls `jax.tree_map` on every insert (`delete_pytree`), which JAX removed (AttributeError on
JAX 0.10), and needs grpc/prometheus/shortuuid; we do not patch JAX for it.

Importing this module needs `jetstream`: `engine_api` imports `seqio`, which imports
TensorFlow and tensorflow-text (see the README, "Scaling out", for the --no-deps install).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

from espo_jax.rollout.engine import DecodeState, Engine, Generation, Prefix, request_key
from espo_jax.rollout.sampling import SamplingConfig


class TokenizerAdapter(tokenizer_api.Tokenizer):
    """An espo_jax tokenizer (`encode`/`decode`, pad/bos/eos ids) as JetStream's Tokenizer.

    `stop_tokens` are the engine's stop tokens (JetStream's default, {eos, pad}, would also end
    a sample at a sampled pad id, which the engine does not do).
    """

    def __init__(self, tokenizer: Any, stop_tokens: Sequence[int], prefill_len: Any):
        self.tokenizer = tokenizer
        self._stop = set(int(t) for t in stop_tokens)
        self._prefill_len = prefill_len

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        ids = self.tokenizer.encode(s, add_bos=kwargs.get("is_bos", True))
        padded = np.full(self._prefill_len(len(ids)), self.pad_id, np.int32)
        padded[: len(ids)] = ids
        return padded, len(ids)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        try:  # a sampled id beyond the vocabulary (embedding rows > symbols) is not a crash
            return self.tokenizer.decode(token_ids, stop_at_eos=False, errors="replace")
        except TypeError:  # tokenizers without `errors` (HF files: every id decodes)
            return self.tokenizer.decode(token_ids, stop_at_eos=False)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def bos_id(self) -> int:
        return int(self.tokenizer.bos_id)

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._stop)


class JetStreamEngine(engine_api.Engine):
    """`engine` (with weights loaded) through JetStream's Engine API; see the module doc.

    `sampling` (default: the engine's) applies to every sample; changing it never recompiles.
    """

    def __init__(self, engine: Engine, tokenizer: Any = None, *, rng: jax.Array | None = None,
                 sampling: SamplingConfig | None = None):
        if engine.params is None:
            raise ValueError("the engine has no weights: call engine.load_params first")
        self.engine = engine
        self.tokenizer = tokenizer
        self.rng = jax.random.key(0) if rng is None else rng
        self.sampling = engine.sampling if sampling is None else sampling
        self._sampling = engine.slot_sampling(self.sampling)
        self._inserted = 0
        b = engine.max_slots
        self._live = np.zeros(b, bool)  # slot holds a sample JetStream has not finished reading
        self._reported = np.zeros(b, np.int64)  # tokens of the slot's sample already returned

    # -- weights and state ----------------------------------------------------------------------
    def load_params(self, params: dict | None = None, *args, **kwargs) -> dict:
        """Engine-precision params (the engine's current ones when `params` is None)."""
        if params is not None:
            self.engine.load_params(params)
        return self.engine.params

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        self._live[:] = False
        self._reported[:] = 0
        return self.engine.init_decode_state()

    # -- the three calls ----------------------------------------------------------------------
    def prefill(
        self,
        *,
        params: dict,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array,
        true_length: int,
    ) -> Prefix:
        if existing_prefix is not None:
            raise ValueError("existing_prefix (prefix reuse) is not supported by the JAX engine")
        tokens = np.asarray(padded_tokens)[: int(true_length)]
        return self.engine.prefill(params, tokens.tolist())

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        key = request_key(self.rng, self._inserted, 0)
        self._inserted += 1
        self._live[slot], self._reported[slot] = True, 0
        return self.engine.insert(prefix, decode_state, slot, key, self._sampling)

    def generate(
        self, params: dict, decode_state: DecodeState
    ) -> tuple[DecodeState, engine_api.ResultTokens]:
        state, _ = self.engine.generate(params, decode_state)
        s = self.engine.steps_per_sync
        pos, prompt_len, tokens = jax.device_get(
            (state.pos_B, state.prompt_len_B, state.tokens_BxS))
        data = np.zeros((self.engine.max_slots, 2 * s + 1), np.int32)
        for b in np.flatnonzero(self._live):
            start = int(prompt_len[b] + self._reported[b])
            n = min(s, int(pos[b]) + 1 - start)  # sampled tokens sit at [prompt_len, pos]
            data[b, :n] = tokens[b, start:start + n]
            data[b, s:s + n] = 1
            self._reported[b] += n
            self._live[b] = n > 0
            data[b, 2 * s] = self._reported[b]
        return state, engine_api.ResultTokens(
            data, tokens_idx=(0, s), valid_idx=(s, 2 * s), length_idx=(2 * s, 2 * s + 1),
            samples_per_slot=1)

    def generation(self, decode_state: DecodeState, slot: int) -> Generation:
        """Tokens, behaviour log-probs and routing of the sample in `slot` so far."""
        pos, n = (int(x) for x in jax.device_get(
            (decode_state.pos_B[slot], decode_state.prompt_len_B[slot])))
        tokens, logprobs, experts = jax.device_get((
            decode_state.tokens_BxS[slot, n:pos + 1],
            decode_state.logprobs_BxS[slot, n:pos + 1],
            decode_state.experts_BxSxMxk[slot, :pos + 1]))
        stopped = int(tokens[-1]) in self.sampling.stop_tokens
        routed = np.asarray(experts, np.int16) if self.engine.config.n_moe_layers else None
        return Generation(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32), routed,
                          "stop" if stopped else "length")

    # -- tokenizer and topology ---------------------------------------------------------------
    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path="espo_jax")

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenizerAdapter:
        if self.tokenizer is None:
            raise ValueError("JetStreamEngine was built without a tokenizer")
        return TokenizerAdapter(self.tokenizer, self.sampling.stop_tokens,
                                self.engine.prefill_len)

    def get_prefix_destination_sharding(self) -> Any:
        return None  # one host: prefixes stay where the engine put them

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_cache_len - self.sampling.max_new_tokens

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))

    @property
    def colocated_cpus(self) -> None:
        return None
