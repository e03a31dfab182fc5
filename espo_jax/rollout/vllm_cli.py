"""The vLLM rollout worker's command line: the rollout worker loop with a `VllmSampler`.

    python -m espo_jax.rollout.vllm_cli --config experiments/<name>.py --workdir W \\
        [--config.x.y=v ...] [--worker_index=I --num_workers=N] [--until_version=V] [--stats=F]

(the same as `python -m espo_jax.main ... --config.mode=rollout --config.rollout.engine=vllm`).
The flags, the loop and the reading of the config are the JAX worker's
(`espo_jax.rollout.worker.main_from_config`): the policy from W/weights (each version's Hugging
Face export, which the learner writes when `rollout.engine` is "vllm"), scored groups to
`config.buffer.dir` or W/buffer with `meta["worker"]` = "vllm-I", status and scheduler state in
W/workers, the `PromptScheduler` over the worker's share of the training prompts, the task's
reward pool, flow control. What differs is the sampler: `config.rollout`'s sampling
(temperature, top-k, top-p, max_new_tokens, stop at the tokenizer's EOS) and the vLLM settings
of `config.rollout.vllm` (`worker_config`). Everything that can be refused without weights (the
config, vLLM's version, FP8 or routing capture without a GPU) is, before anything is prepared.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

from espo_jax import run_setup
from espo_jax.choices import VLLM_QUANTIZATIONS
from espo_jax.rollout.vllm_worker import (
    VllmSampler,
    VllmWorkerConfig,
    check_accelerator,
    require_vllm,
)


def worker_config(config, stop_tokens: Sequence[int], seed: int) -> VllmWorkerConfig:
    """`config.rollout` sampling, `config.zve.n_samples` and `config.rollout.vllm`."""
    r, v = config.rollout, config.rollout.vllm
    if v.quantization not in VLLM_QUANTIZATIONS:
        raise ValueError(f"config.rollout.vllm.quantization={v.quantization!r} is not one of "
                         f"{VLLM_QUANTIZATIONS}")
    try:
        llm_kwargs = json.loads(v.llm_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"config.rollout.vllm.llm_kwargs={v.llm_kwargs!r} is not JSON: {e}") from e
    if not isinstance(llm_kwargs, dict):
        raise ValueError(f"config.rollout.vllm.llm_kwargs must be a JSON object, got "
                         f"{v.llm_kwargs!r}")
    return VllmWorkerConfig(
        n_samples=config.zve.n_samples,
        sampling=run_setup.sampling_config(config, stop_tokens),
        quantization=None if v.quantization == "none" else v.quantization,
        capture_routing=v.capture_routing, dtype=v.dtype, seed=seed,
        max_model_len=v.max_model_len or r.max_prompt_len + r.max_new_tokens,
        gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size, enforce_eager=v.enforce_eager,
        reload=v.reload, llm_kwargs=llm_kwargs,
    )


def main_from_config(config, workdir: str, index: int = 0, num_workers: int = 1, *,
                     max_batches: int | None = None, until_version: int | None = None,
                     stats: str | None = None, exit_with_parent: bool = False) -> int:
    """See the module doc; the arguments are `worker.main_from_config`'s."""
    import jax

    jax.config.update("jax_platforms", "cpu")  # JAX only reads prompts here: the GPUs are vLLM's
    from espo_jax import config_validation
    from espo_jax.rollout import worker

    m = config.mesh  # the learner's mesh: nothing of it runs here
    config_validation.validate(config, n_devices=m.data * m.fsdp * m.expert * m.tensor)
    tokenizer = run_setup.load_run_tokenizer(config)
    require_vllm()  # fail fast: before preparing data and waiting for weights
    os.makedirs(workdir, exist_ok=True)
    if not config.rollout.max_prompt_len:  # 0: sized from the task's prompts, which vLLM's
        run_setup.prompt_sets(config, workdir, tokenizer)  # max_model_len needs first
    wc = worker_config(config, (tokenizer.eos_id,), seed=config.seed * 1000 + index)
    check_accelerator(wc.quantization, wc.capture_routing)
    sampler = VllmSampler(wc, log=functools.partial(print, flush=True))
    return worker.main_from_config(config, workdir, index, num_workers, max_batches=max_batches,
                                   until_version=until_version, stats=stats, sampler=sampler,
                                   exit_with_parent=exit_with_parent)


def main(argv: list[str]) -> int:
    from absl import app

    from espo_jax.rollout import worker_flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    return main_from_config(worker_flags.CONFIG.value, worker_flags.WORKDIR.value,
                            **worker_flags.worker_args())


if __name__ == "__main__":  # vLLM's worker processes re-import __main__: keep this guard.
    from absl import app, flags

    from espo_jax.rollout import worker_flags

    flags.adopt_module_key_flags(worker_flags)  # --help lists them
    app.run(main)
