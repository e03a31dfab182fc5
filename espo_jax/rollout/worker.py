"""The rollout worker's entry points: its command line and its construction from a config.

`main_from_config` builds a `worker_loop.RolloutWorker` (the loop; its status, stop and flow
control in `worker_status`) from an experiment config, in-process or as its own process:

    python -m espo_jax.rollout.worker --config experiments/<name>.py --workdir W

(the same as `python -m espo_jax.main ... --config.mode=rollout --config.rollout.engine=jax`).
Weights from W/weights, groups to `config.buffer.dir` or W/buffer, status and state in
W/workers; the flags, the same for the vLLM worker (`espo_jax.rollout.vllm_cli`), are in
`espo_jax.rollout.worker_flags`.
"""

from __future__ import annotations

import functools
import os

import jax

from espo_jax import config_imports, run_setup, tasks
from espo_jax.rollout.sampler import Sampler
from espo_jax.rollout.worker_loop import RolloutWorker


def main(argv: list[str]) -> int:
    """`python -m espo_jax.rollout.worker`: the flags of `espo_jax.rollout.worker_flags`."""
    from absl import app

    from espo_jax import compile_cache, config_validation
    from espo_jax.rollout import worker_flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config, workdir = worker_flags.CONFIG.value, worker_flags.WORKDIR.value
    compile_cache.enable()  # the main job's cache (espo_jax.main)
    config_validation.validate(config, n_devices=jax.device_count())
    os.makedirs(workdir, exist_ok=True)
    return main_from_config(config, workdir, **worker_flags.worker_args())


def main_from_config(config, workdir: str, index: int = 0, num_workers: int = 1, *,
                     max_batches: int | None = None, until_version: int | None = None,
                     stats: str | None = None, sampler: Sampler | None = None,
                     exit_with_parent: bool = False, log_path: str | None = None) -> int:
    """A worker built from an experiment config (`python -m espo_jax.main --mode=rollout`, the
    async loop's worker processes, `python -m espo_jax.rollout.worker`, and with a
    `vllm_worker.VllmSampler` the vLLM worker).

    Weights from WORKDIR/weights (where the learner publishes), groups to the configured buffer
    (default WORKDIR/buffer), status and scheduler state in WORKDIR/workers. Worker `index` of
    `num_workers` runs a `PromptScheduler` (`config.zve`: stages 0, 1, 5) over every
    `num_workers`-th training prompt from the `index`-th, `rollout.prompts_per_step //
    num_workers` prompts per batch, its own RNG stream: workers never duplicate each other's
    groups. Flow control from `train.max_staleness` and `rollout.max_inflight_batches`. It
    stops after `max_batches`, after a batch sampled at policy version >= `until_version`, when
    the learner is done, or on SIGTERM; `stats`: a JSON file for the run's counters.
    """
    config_imports.import_modules(config)  # a spawned worker has not validated its config
    setup = run_setup.build_worker(
        config, workdir, index, num_workers, writer="vllm" if sampler is not None else "rollout",
        max_batches=max_batches, until_version=until_version, exit_with_parent=exit_with_parent)
    wc = setup.worker_config
    reward, target_fn = tasks.reward_fn(setup.task)
    if log_path:  # a worker the learner spawned: its lines go to a file, not the console
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        log_file = open(log_path, "a")  # noqa: SIM115 (open for the worker's lifetime)
        log = functools.partial(print, file=log_file, flush=True)
    else:
        log = functools.partial(print, flush=True)
    log(f"rollout worker {index} of {num_workers}: {len(setup.prompts)} prompts, "
        f"{wc.prompts_per_batch} per batch, at most {wc.max_ahead} batches ahead of the learner")
    worker = RolloutWorker(wc, setup.scheduler, reward,
                           detokenize=tasks.decoder(config, setup.tokenizer), target_fn=target_fn,
                           log=log, sampler=sampler, task_name=setup.task.name,
                           expected_model=setup.expected_model)
    worker.install_signal_handlers()
    counters = worker.run()
    if stats:
        import json

        with open(stats, "w") as f:
            json.dump(counters, f)
    return 0


if __name__ == "__main__":
    from absl import app, flags

    from espo_jax import host_memory
    from espo_jax.rollout import worker_flags

    host_memory.reexec_with_huge_pages()  # glibc's huge pages for XLA's buffers (a restart)

    flags.adopt_module_key_flags(worker_flags)  # --help lists them
    app.run(main)
