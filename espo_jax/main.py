"""The main job: `python -m espo_jax.main --config experiments/<name>.py --workdir DIR`.

`--config.x.y=v` overrides a field. Modes: `--config.mode=train` (default: the learner; with
`train.loop=sync` the embedded engine runs in the same process) and `--config.mode=rollout` (a
rollout worker process for the async layout: `--config.rollout.engine=jax` the JAX worker,
`espo_jax.rollout.worker`; `vllm` the vLLM one, `espo_jax.rollout.vllm_cli`; both take the flags
of `espo_jax.rollout.worker_flags`: `--worker_index`, `--num_workers`, ...).

The learner records its start in WORKDIR/config.json; started again with another config it stops
before any work unless `--allow_config_change`, and a finished run is not run again
(`espo_jax.run_record`).
"""

import logging
import os
import sys

from absl import app, flags

from espo_jax.rollout import worker_flags  # --config, --workdir and the rollout worker's flags

# Multi-host (espo_jax/distributed.py): else ESPO_COORDINATOR / ESPO_NUM_PROCESSES /
# ESPO_PROCESS_ID, else Slurm or ESPO_DISTRIBUTED=auto (TPU), else one process.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "JAX processes (hosts)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "resume WORKDIR with a config that differs from its "
    "config.json in more than the run-length keys (espo_jax/run_record.py); the change is logged")


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config, workdir = worker_flags.CONFIG.value, worker_flags.WORKDIR.value
    if (config.mode, config.rollout.engine) == ("rollout", "vllm"):
        from espo_jax.rollout import vllm_cli  # before JAX starts: vLLM owns the accelerators

        return vllm_cli.main_from_config(config, workdir, **worker_flags.worker_args())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from espo_jax import console

    console.quiet(flags.FLAGS.verbosity)
    import jax

    from espo_jax import cli_errors, compile_cache, config_validation, distributed

    compile_cache.enable()

    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    try:
        config_validation.validate(config, n_devices=jax.device_count())
        if jax.process_count() > 1 and (config.mode, config.train.loop) != ("train", "async"):
            raise ValueError(f"{jax.process_count()} JAX processes: only the learner of "
                             "train.loop=async runs multi-host (rollout workers are single "
                             "processes)")
    except ValueError as e:  # one message, no traceback (espo_jax.cli_errors)
        return cli_errors.fail(e, flags.FLAGS.verbosity)
    logging.getLogger().setLevel(logging.INFO)
    log_path = console.log_to_file(workdir)
    logging.info("GLIBC_TUNABLES=%s (espo_jax.host_memory)", os.environ.get("GLIBC_TUNABLES", ""),
                 extra=console.FILE_ONLY)
    if config.mode == "rollout":
        from espo_jax.rollout import worker

        try:
            return worker.main_from_config(config, workdir, **worker_flags.worker_args())
        except cli_errors.UserError as e:
            return cli_errors.fail(e, flags.FLAGS.verbosity)
    from espo_jax import run_record  # config.json: kept, compared on resume; a finished run

    try:
        done = run_record.start(config, workdir, sys.argv, _ALLOW_CONFIG_CHANGE.value)
    except run_record.ConfigChangedError as e:
        print(e, file=sys.stderr)
        return 2
    if done:
        print(run_record.finished_line(workdir, done))
        return 0
    try:
        if config.train.loop == "async":
            from espo_jax.train import async_loop

            summary = async_loop.run_async(config, workdir)
        else:
            from espo_jax.train import loop

            summary = loop.run_sync(config, workdir)
    except cli_errors.UserError as e:  # the task's fault: one line and its own frames
        return cli_errors.fail(e, flags.FLAGS.verbosity)
    print(f"\n{console.summary_table(summary)}\n  summary.json  "
          f"{os.path.join(workdir, 'summary.json')}\n  full log      {log_path}")
    return 0


if __name__ == "__main__":
    from espo_jax import host_memory

    host_memory.reexec_with_huge_pages()  # glibc's huge pages for XLA's buffers (a restart)
    flags.adopt_module_key_flags(worker_flags)  # --help lists them
    from espo_jax import cli_errors

    sys.exit(app.run(main, flags_parser=cli_errors.parse_flags))
