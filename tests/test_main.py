"""The main job: `python -m espo_jax.main` stops on a bad value before anything is compiled or
written; its command line (the rollout workers' flags, absl's usage errors) and
`--config.mode=rollout`. Config validation itself: tests/test_configs.py."""

import json
import os
import re
import subprocess
import sys

from espo_jax import host_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_rejects_bad_value_before_compiling(tmp_path):
    workdir = tmp_path / "run"
    env = dict(os.environ, JAX_LOG_COMPILES="1")  # every jit compile would be logged
    proc = subprocess.run(
        [sys.executable, "-m", "espo_jax.main", "--config",
         os.path.join(REPO, "experiments", "arith_espo.py:small"), "--workdir", str(workdir),
         "--config.train.replay=bogus"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    # One message, no traceback (espo_jax.cli_errors).
    assert ("error: invalid config: config.train.replay='bogus' is not one of "
            "('r3', 'r2', 'off')") in out.splitlines()
    assert "Traceback" not in out and len(out.splitlines()) == 2, out
    assert "Compiling" not in out and "Finished tracing" not in out
    assert not workdir.exists()  # nothing prepared or written: no data, no checkpoints


def test_command_line_errors_are_one_message_and_verbosity_1_keeps_the_traceback(tmp_path):
    """A field the config lacks, a value of the wrong type, a config file that is not there:
    each one line naming the flag; `--verbosity=1` raises with the traceback instead."""
    work = str(tmp_path / "run")
    for args, said in [
            (["--config.train.step=3"], "error: --config.train.step: the config has no field "
                                        "'step' Did you mean \"steps\" instead of \"step\"?"),
            (["--config.train.steps=abc"], "error: flag --config.train.steps=abc: invalid "
                                           "literal for int() with base 10: 'abc'")]:
        proc = _main("--workdir", work, *args, timeout=120)
        assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
        assert proc.stderr.splitlines()[0] == said and "Traceback" not in proc.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "espo_jax.main", "--config", "experiments/nosuch.py",
         "--workdir", work], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.splitlines()[0] == (
        "error: [Errno 2] No such file or directory: 'experiments/nosuch.py'")
    for args in (["--config.train.step=3", "--verbosity=1"],
                 ["--config.train.replay=bogus", "-v", "1"]):
        loud = _main("--workdir", work, *args, timeout=120)
        assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr
    assert not (tmp_path / "run").exists()


def _main(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "espo_jax.main", "--config",
                           os.path.join(REPO, "experiments", "arith_espo.py:small"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_main_takes_the_rollout_workers_flags():
    helped = subprocess.run([sys.executable, "-m", "espo_jax.main", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    for flag in ("--config", "--workdir", "--worker_index", "--num_workers", "--max_batches",
                 "--until_version", "--stats", "--coordinator_address"):
        assert f"  {flag}: " in helped.stdout, (flag, helped.stdout)
    bad = _main("--workdir", "/nonexistent/run", "--publish_dir=w")
    assert bad.returncode == 1 and "Unknown command line flag 'publish_dir'" in bad.stderr


def test_rollout_mode_starts_the_configured_engine(tmp_path):
    """`--config.mode=rollout`: the JAX worker with rollout.engine=jax (here until
    `--max_batches=0`: it loads the published weights, writes its counters and stops), the
    vLLM worker with rollout.engine=vllm (here without vLLM: it says so before anything runs)."""
    import importlib.util

    import jax

    from espo_jax import models
    from espo_jax.buffer import weights

    tiny = models.get_preset("tiny")
    weights.publish(tmp_path / "weights", 3, tiny,
                    jax.device_get(models.init_params(tiny, jax.random.key(0))))
    stats = tmp_path / "stats.json"
    jax_worker = _main("--workdir", str(tmp_path), "--config.mode=rollout",
                       "--config.rollout.engine=jax", "--max_batches=0", f"--stats={stats}")
    assert jax_worker.returncode == 0, jax_worker.stderr[-3000:]
    counters = json.loads(stats.read_text())
    assert (counters["worker/batches"], counters["worker/policy_version"]) == (0, 3)
    if importlib.util.find_spec("vllm") is None:
        vllm_worker = _main("--workdir", str(tmp_path / "vllm"), "--config.mode=rollout",
                            "--config.rollout.engine=vllm", timeout=120)
        assert vllm_worker.returncode == 1 and "vLLM is not importable" in vllm_worker.stderr
        assert not (tmp_path / "vllm").exists()


def test_default_console_is_short_and_the_log_file_keeps_everything(tmp_path):
    """At the default verbosity: progress bars, espo_jax's messages and the summary table on
    the console; orbax's INFO records (hundreds per run) only in WORKDIR/log.txt."""
    workdir = tmp_path / "run"
    # Chosen on validation, reported on test: validation during the run, test once at the end.
    proc = _main("--workdir", str(workdir), "--config.train.steps=3",
                 "--config.eval.split=validation", "--config.eval.final_test=True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = (proc.stdout + proc.stderr).splitlines()
    assert len(console) < 40, "\n".join(console)
    text = "\n".join(console)
    assert "checkpoint_manager.py" not in text and "Unable to initialize backend" not in text
    # Nothing from TFDS (its "Downloading and preparing dataset Unknown size" banner, a
    # dataset_info.json warning) and no absl-prefixed lines ("I1205 14:57:13.33 ... loop.py:152]").
    assert "Downloading" not in text and "dataset_info.json" not in text, text
    assert not [line for line in console if re.match(r"[IWEF]\d{4} \d\d:\d\d", line)], text
    assert any(re.fullmatch(r"held-out accuracy before RL: \d\.\d{3} on 8 validation prompts",
                            line) for line in console), text
    assert "RL         [########################] 3/3" in text  # the RL bar's last line
    assert "held-out accuracy" in text and "summary.json" in text
    log = (workdir / "log.txt").read_text()
    assert "checkpoint_manager.py" in log and "RL step 3/3" in log
    assert "on 8 validation prompts" in log and "test accuracy after 3 RL steps" in log
    assert "(generated locally, nothing downloaded)" in log
    # The job restarted itself under glibc's huge pages where this machine takes them.
    wanted = host_memory.huge_pages_env(os.environ, host_memory.thp_mode(),
                                        host_memory.glibc_version())
    tunables = os.environ.get("GLIBC_TUNABLES", "") if wanted is None else wanted[
        "GLIBC_TUNABLES"]
    assert f"GLIBC_TUNABLES={tunables} (espo_jax.host_memory)" in log
    summary = json.loads((workdir / "summary.json").read_text())
    assert "test accuracy (end)" in text
    # One name per figure (espo_jax.zve.accounting), as in summary.json.
    rows = dict(m.groups() for m in map(re.compile(r"  (\S.*?)  +(\S+)$").fullmatch, console)
                if m)
    assert rows["no-signal token frac"] == f"{summary['no_signal_token_frac']:.3f}"
    assert rows["no-signal token frac with offline"] == (
        f"{summary['no_signal_token_frac_with_offline']:.3f}")
    assert "wasted" not in text and "wasted_token_fraction" not in summary
    assert summary["test_accuracy"] == summary["test"]["eval/accuracy"]
    evals = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "test/accuracy" in r] == [3]


def test_console_filter_keeps_warnings_and_espo_jax_info():
    import logging

    from espo_jax import console

    f = console._ConsoleFilter()

    def record(path, level, msg="m", **extra):
        r = logging.LogRecord("absl", level, path, 1, msg, None, None)
        r.__dict__.update(extra)
        return r

    ours = os.path.join(REPO, "espo_jax", "train", "loop.py")
    assert f.filter(record(ours, logging.INFO))
    assert not f.filter(record(ours, logging.INFO, **console.FILE_ONLY))
    assert not f.filter(record("/site-packages/orbax/checkpoint/x.py", logging.INFO))
    assert f.filter(record("/site-packages/orbax/checkpoint/x.py", logging.WARNING))
    assert not f.filter(record("/tfds/dataset_builder.py", logging.WARNING,
                               "Using custom data configuration: X"))
    assert f.filter(record("/tfds/dataset_builder.py", logging.ERROR,
                           "Using custom data configuration: X"))
