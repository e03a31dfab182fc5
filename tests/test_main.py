"""The main job: `python -m espo_jax.main` stops on a bad value before anything is compiled or
written; its command line (the rollout workers' flags, absl's usage errors) and
`--config.mode=rollout`. Config validation itself: tests/test_configs.py."""

import json
import os
import re
import subprocess
import sys

import pytest

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


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """(workdir, finished process) of a 3-step `arith_espo.py:small` run; tests that change
    the workdir work on a copy."""
    workdir = tmp_path_factory.mktemp("main") / "run"
    # Chosen on validation, reported on test: validation during the run, test once at the end.
    proc = _main("--workdir", str(workdir), "--config.train.steps=3",
                 "--config.eval.split=validation", "--config.eval.final_test=True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, proc


def test_default_console_is_short_and_the_log_file_keeps_everything(finished_run):
    """At the default verbosity: progress bars, espo_jax's messages and the summary table on
    the console; orbax's INFO records (hundreds per run) only in WORKDIR/log.txt."""
    workdir, proc = finished_run
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


# ---- WORKDIR/config.json: kept at start, compared on resume (espo_jax/run_record.py) -----------
RUN_FLAGS = ("--config.train.steps=3", "--config.eval.split=validation",
             "--config.eval.final_test=True")  # the finished_run's overrides


def _leaves(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict)
                   else {prefix + key: value})
    return out


def _files(workdir):
    """{path: (size, mtime)} of everything in `workdir` but the log file (which every start
    appends to)."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in workdir.rglob("*")
            if p.is_file() and p.name != "log.txt"}


def test_the_run_keeps_its_config_command_line_commit_and_versions(finished_run):
    import datetime
    from importlib import metadata

    import espo_jax
    from espo_jax import configs

    workdir, proc = finished_run
    record = json.loads((workdir / "config.json").read_text())
    expected = configs.experiment_config("arith_espo", "small")
    expected.train.steps, expected.eval.split, expected.eval.final_test = 3, "validation", True
    assert record["config"] == json.loads(expected.to_json())
    assert record["command"] == " ".join([
        "python -m espo_jax.main --config", os.path.join(REPO, "experiments",
                                                       "arith_espo.py:small"),
        "--workdir", str(workdir), *RUN_FLAGS])
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert record["git_commit"] == (git.stdout.strip() if git.returncode == 0 else None)
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
        assert record["versions"][name] == metadata.version(name), name
    assert record["versions"]["espo_jax"] == espo_jax.__version__
    started = datetime.datetime.fromisoformat(record["time"])
    assert started <= datetime.datetime.fromtimestamp(
        (workdir / "summary.json").stat().st_mtime, datetime.UTC)
    assert record["changes"] == {} and "history" not in record
    # `:small` says on the console, before its first phase, that it is a plumbing check.
    text = proc.stdout + proc.stderr
    assert text.count("plumbing check (`:small`), model `tiny` (random weights): 2 warm-start "
                      "steps, then 3 RL steps of 4 prompts x 4 samples") == 1
    assert "accuracy is not expected to move" in text
    assert proc.stdout.index("plumbing check") == 0  # before any other output on stdout
    assert text.index("plumbing check") < text.index("warm start [")


def test_a_finished_run_started_again_says_so_and_changes_nothing(finished_run):
    workdir, _ = finished_run
    before = _files(workdir)
    summary = (workdir / "summary.json").read_bytes()
    again = _main("--workdir", str(workdir), *RUN_FLAGS)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == [
        f"{workdir}: finished (3 RL steps done), nothing to run; summary: "
        f"{workdir / 'summary.json'}"]
    assert "RL  " not in again.stderr and "plumbing check" not in again.stdout
    assert (workdir / "summary.json").read_bytes() == summary
    assert _files(workdir) == before


def test_a_changed_config_is_refused_before_any_work(finished_run):
    """The default experiment's workdir started with GRPO and another lr: refused, every key
    that differs named with its stored and new value (train.steps, a run-length key, is not)."""
    from espo_jax import configs

    workdir, _ = finished_run
    before = _files(workdir)
    env = dict(os.environ, JAX_LOG_COMPILES="1")  # every jit compile would be logged
    proc = subprocess.run(
        [sys.executable, "-m", "espo_jax.main", "--config",
         os.path.join(REPO, "experiments", "arith_grpo.py:small"), "--workdir", str(workdir),
         "--config.optim.lr=0.1"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    stored = _leaves(json.loads((workdir / "config.json").read_text())["config"])
    new = configs.experiment_config("arith_grpo", "small")
    new.optim.lr = 0.1
    new = _leaves(json.loads(new.to_json()))
    differ = {k for k in new if new[k] != stored[k]} - {"train.steps"}
    assert {"loss.name", "optim.lr", "eval.split", "eval.final_test"} <= differ
    for key in sorted(differ):
        assert f"\n  {key}: {json.dumps(stored[key])} -> {json.dumps(new[key])}\n" in proc.stderr
    assert f"; {len(differ)} key(s) differ:" in proc.stderr
    assert '  loss.name: "espo" -> "grpo"' in proc.stderr and "  optim.lr: 0.0003 -> 0.1" in \
        proc.stderr
    assert "train.steps: " not in proc.stderr and "--allow_config_change" in proc.stderr
    assert "Compiling" not in proc.stderr and "Traceback" not in proc.stderr
    assert _files(workdir) == before  # no data prepared, no checkpoint read or written


@pytest.mark.slow  # one more RL step, compiled anew (another lr and schedule length): ~60 s
def test_a_changed_config_goes_on_with_the_flag_logged_and_recorded(finished_run, tmp_path):
    """On a copy of the finished run: one more RL step (a run-length key) at another lr, on
    purpose; the warning names both changes, config.json keeps the first start in `history`."""
    import shutil

    workdir = tmp_path / "run"
    shutil.copytree(finished_run[0], workdir)
    first = json.loads((workdir / "config.json").read_text())
    lr = first["config"]["optim"]["lr"]
    proc = _main("--workdir", str(workdir), "--config.train.steps=4",
                 "--config.eval.split=validation", "--config.eval.final_test=True",
                 "--config.optim.lr=0.001", "--allow_config_change")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"optim.lr: {json.dumps(lr)} -> 0.001; train.steps: 3 -> 4" in proc.stderr)
    record = json.loads((workdir / "config.json").read_text())
    assert record["changes"] == {"optim.lr": {"old": lr, "new": 0.001},
                                 "train.steps": {"old": 3, "new": 4}}
    assert record["history"] == [first]
    assert (record["config"]["optim"]["lr"], record["config"]["train"]["steps"]) == (0.001, 4)
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 4
    rl = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl if r["phase"] == "rl" and "train/loss" in r] == [1, 2, 3, 4]


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
