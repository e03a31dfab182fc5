"""The sampler interface a rollout worker drives: load a weights version, generate groups.

    class Sampler(Protocol):
        sampler_name: str            # the records' `sampler`, e.g. "jax-fp8", "vllm-fp8"
        n_experts: int | None        # experts per MoE layer of the loaded model (None: dense)
        last_stats: Mapping          # of the last `generate_groups` ("engine/tokens_per_s", ...)
        def load(self, version, path, model_config): ...   # a published version (buffer.weights)
        def generate_groups(self, requests, *, rng, admission, predictor, on_group): ...
        def request_stop(self): ...  # return at the next chance with the complete groups only

`generate_groups` returns one `batching.GenerationGroup` per `batching.Request` (tokens,
behaviour log-probs, routed experts, finish reason per response), in request order, and calls
`on_group(group)` as each finishes so rewards are scored while the rest is generated. Two
implementations: `JaxSampler` (the embedded engine, here) and `vllm_worker.VllmSampler`. The
worker loop (`espo_jax.rollout.worker_loop.RolloutWorker`), prompt scheduling, reward pool,
verifier and detokeniser are the same for both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import jax
from etils import epath

from espo_jax.buffer import weights
from espo_jax.models.config import ModelConfig
from espo_jax.rollout.batching import GenerationGroup, Request
from espo_jax.rollout.engine import Engine
from espo_jax.rollout.sampling import SamplingConfig


class Sampler(Protocol):
    sampler_name: str
    n_experts: int | None
    last_stats: Mapping[str, float]

    def load(self, version: int, path: epath.Path, model_config: ModelConfig) -> None: ...

    def generate_groups(self, requests: Sequence[Request], *, rng: jax.Array,
                        admission: str = "fifo", predictor=None,
                        on_group: Callable[[GenerationGroup], None] | None = None
                        ) -> list[GenerationGroup]: ...

    def request_stop(self) -> None: ...


class JaxSampler:
    """The embedded JAX engine as a `Sampler`: the engine is built at the first load (and again
    if a published version changes the architecture), weights replaced in memory after that."""

    def __init__(self, sampling: SamplingConfig, *, precision: str = "fp32", max_slots: int = 8,
                 max_cache_len: int = 256, steps_per_sync: int = 4, prefill_rows: int = 16,
                 shards: int = 1):
        self.sampling, self.precision = sampling, precision
        self._engine_args = dict(max_slots=max_slots, max_cache_len=max_cache_len,
                                 steps_per_sync=steps_per_sync, prefill_rows=prefill_rows,
                                 shards=shards)
        self.engine: Engine | None = None
        self.model_config: ModelConfig | None = None
        self.n_experts: int | None = None
        self._stop = False

    @property
    def sampler_name(self) -> str:
        return f"jax-{self.precision}"

    @property
    def last_stats(self) -> Mapping[str, float]:
        return self.engine.last_stats if self.engine is not None else {}

    def load(self, version: int, path: epath.Path, model_config: ModelConfig) -> None:
        _, params = weights.load(path)
        if model_config != self.model_config:
            self.engine = Engine(model_config, sampling=self.sampling, precision=self.precision,
                                 **self._engine_args)
            self.model_config = model_config
            if self._stop:
                self.engine.request_stop()
        self.engine.load_params(params)
        self.n_experts = model_config.n_experts if model_config.n_moe_layers else None

    def generate_groups(self, requests, **kwargs) -> list[GenerationGroup]:
        return self.engine.generate_groups(requests, **kwargs)

    def request_stop(self) -> None:
        self._stop = True
        if self.engine is not None:
            self.engine.request_stop()
