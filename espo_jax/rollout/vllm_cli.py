"""The vLLM rollout worker's command line: a `VllmWorker` built from an experiment config.

    python -m espo_jax.rollout.vllm_cli --config experiments/<name>.py --workdir W \\
        [--config.x.y=v ...] [--worker_index=I --num_workers=N] [--until_version=V] [--stats=F]

(the same as `python -m espo_jax.main ... --config.mode=rollout --config.rollout.engine=vllm`).
The flags are the JAX worker's (`espo_jax.rollout.worker_flags`), and so is the reading of the
config: the policy from W/weights (each version's Hugging Face export, which the learner writes
when `rollout.engine` is "vllm"), groups to `config.buffer.dir` or W/buffer, the task's training
prompts (every N-th from the I-th, cycled) as `run_setup.build` makes them, `config.rollout`'s
sampling (temperature, top-k, top-p, max_new_tokens, stop at the tokenizer's EOS),
`config.zve.n_samples` responses per prompt, `config.rollout.prompts_per_step` prompts per batch,
and the vLLM settings of `config.rollout.vllm`.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from collections.abc import Iterator, Sequence

from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.rollout.vllm_worker import (
    PolicySource,
    VllmWorker,
    VllmWorkerConfig,
    check_accelerator,
    require_vllm,
    run,
    weights_source,
)

WEIGHTS_TIMEOUT_S = 600.0  # wait for the first published version (as the JAX worker)
Prompt = tuple[str | int, list[int]]  # (prompt_id, token ids)


def worker_config(config, stop_tokens: Sequence[int], seed: int) -> VllmWorkerConfig:
    """`config.rollout` sampling, `config.zve.n_samples` and `config.rollout.vllm`."""
    r, v = config.rollout, config.rollout.vllm
    if v.quantization not in ("fp8", "none"):
        raise ValueError(f"config.rollout.vllm.quantization={v.quantization!r} is not one of "
                         "('fp8', 'none')")
    try:
        llm_kwargs = json.loads(v.llm_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"config.rollout.vllm.llm_kwargs={v.llm_kwargs!r} is not JSON: {e}") from e
    if not isinstance(llm_kwargs, dict):
        raise ValueError(f"config.rollout.vllm.llm_kwargs must be a JSON object, got "
                         f"{v.llm_kwargs!r}")
    return VllmWorkerConfig(
        n_samples=config.zve.n_samples,
        sampling=SamplingConfig(r.temperature, r.top_k, r.top_p, r.max_new_tokens,
                                tuple(stop_tokens)),
        quantization=None if v.quantization == "none" else v.quantization,
        capture_routing=v.capture_routing, dtype=v.dtype, seed=seed,
        max_model_len=v.max_model_len or r.max_prompt_len + r.max_new_tokens,
        gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size, enforce_eager=v.enforce_eager,
        reload=v.reload, llm_kwargs=llm_kwargs,
    )


def training_prompts(config, workdir: str, tokenizer, index: int = 0,
                     num_workers: int = 1) -> list[Prompt]:
    """Worker `index`'s RL prompts: the prompt sources and pool subset of `run_setup.build`,
    every `num_workers`-th prompt from the `index`-th (as the JAX worker's `main_from_config`)."""
    from espo_jax import run_setup

    train = run_setup.prompt_sets(config, workdir, tokenizer)[0]
    mine = run_setup.worker_share(train, index, num_workers)
    return [(p["prompt_id"], [int(t) for t in p["tokens"]]) for p in mine]


def prompt_batches(prompts: Sequence[Prompt], size: int, worker: VllmWorker, *,
                   max_batches: int | None = None,
                   until_version: int | None = None) -> Iterator[list[Prompt]]:
    """Batches of `size` prompts, cycling over `prompts`, until `max_batches` or a batch sampled
    at policy version >= `until_version` (`run` reloads before each batch, so the check after a
    yield sees the version that batch used)."""
    stream = itertools.cycle(prompts)
    for n in itertools.count():
        if max_batches is not None and n >= max_batches:
            return
        yield list(itertools.islice(stream, size))
        if until_version is not None and worker.policy_version >= until_version:
            return


def wait_for_policy(source: PolicySource, root: str,
                    timeout_s: float = WEIGHTS_TIMEOUT_S) -> tuple[int, str]:
    deadline = time.monotonic() + timeout_s
    while (latest := source()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no weights published in {root} after {timeout_s} s")
        time.sleep(1.0)
    return latest


def main_from_config(config, workdir: str, index: int = 0, num_workers: int = 1, *,
                     max_batches: int | None = None, until_version: int | None = None,
                     stats: str | None = None) -> int:
    """See the module doc; `stats`: a JSON file for the run's totals."""
    import jax

    jax.config.update("jax_platforms", "cpu")  # JAX only reads prompts here: the GPUs are vLLM's
    from espo_jax import configs
    from espo_jax.buffer import BufferWriter
    from espo_jax.models.tokenizer import load_tokenizer

    m = config.mesh  # the learner's mesh: nothing of it runs here
    configs.validate(config, n_devices=m.data * m.fsdp * m.expert * m.tensor)
    tokenizer = load_tokenizer(config.tokenizer)
    wc = worker_config(config, (tokenizer.eos_id,), seed=config.seed * 1000 + index)
    require_vllm()  # fail fast: before preparing data and waiting for weights
    check_accelerator(wc.quantization, wc.capture_routing)
    os.makedirs(workdir, exist_ok=True)
    prompts = training_prompts(config, workdir, tokenizer, index, num_workers)
    root = os.path.join(workdir, "weights")
    source = weights_source(root)
    version, hf_dir = wait_for_policy(source, root)
    worker = VllmWorker(hf_dir, version, wc)
    log = functools.partial(print, flush=True)
    log(f"[vllm_worker] worker {index} of {num_workers}: {len(prompts)} prompts, policy "
        f"v{worker.policy_version} ({wc.sampler})")
    batches = prompt_batches(prompts, config.rollout.prompts_per_step, worker,
                             max_batches=max_batches, until_version=until_version)
    buffer_dir = config.buffer.dir or os.path.join(workdir, "buffer")
    with BufferWriter(buffer_dir, f"vllm-{index}") as writer:
        totals = run(worker, batches, writer, source, log=log)
    totals |= {"batches": worker.batches, "policy_version": worker.policy_version,
               "reloads": worker.reloads, "sampler": wc.sampler}
    log(json.dumps(totals))
    if stats:
        with open(stats, "w") as f:
            json.dump(totals, f)
    return 0


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
