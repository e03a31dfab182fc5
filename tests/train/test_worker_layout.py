"""The worker layout with real processes (`espo_jax.train.async_loop`, `espo_jax.rollout.worker`):
flow control bounds how far the workers run ahead of a slow learner; a SIGKILLed spawned worker
is restarted and no group is lost or read twice; a SIGKILLed learner resumes from its checkpoint
while external workers keep running; a worker refuses weights of another architecture.

Every process runs with one CPU device (no XLA_FLAGS), in its own session so that whatever it
leaves behind (spawned workers, reward pools) is killed with its process group."""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import pytest
from etils import epath
from helpers.env import one_device_env

from espo_jax import configs, models, run_setup
from espo_jax.buffer import flow, list_shards, weights
from espo_jax.buffer.records import decode
from espo_jax.buffer.shards import OpenShard

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASYNC = os.path.join(REPO, "experiments", "arith_espo_async.py") + ":small"
SYNC = os.path.join(REPO, "experiments", "arith_espo.py") + ":small"
COMMON = ("--config.eval.pass_k=0", "--config.eval.num_prompts=8")
TIMEOUT_S = 600.0


def _config():
    return configs.experiment_config("arith_espo_async", "small")


def _env():
    env = one_device_env()  # one CPU device each
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(log_path, *args, module="espo_jax.main"):
    """`python -m module args`, output to `log_path`, in a session of its own."""
    log = open(log_path, "w")
    try:
        return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=REPO,
                                env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()  # the child has its own descriptor


def _kill_all(procs):
    """SIGKILL each process group (the leader may be gone while its children are not)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _tail(path, n=6000):
    text = epath.Path(path).read_text() if os.path.exists(path) else ""
    return text[-n:]


def _wait_until(predicate, procs, what, timeout_s=TIMEOUT_S, poll_s=0.2):
    """Polls `predicate()` until it returns something truthy; fails if one of `procs` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        for p, log in procs:
            assert p.poll() is None, f"exited {p.returncode} before {what}:\n{_tail(log)}"
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _jsonl(path):
    path = epath.Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rl_rows(workdir):
    return [r for r in _jsonl(workdir / "metrics.jsonl") if r["phase"] == "rl"]


def _buffer_groups_before(buffer_dir, cursor):
    """(worker, prompt id, policy version) of every group the reader's `cursor` has passed:
    whole shards before each stream's position, the first records of the shard it is in."""
    streams = cursor["streams"]
    out = []
    for shard in list_shards(buffer_dir):
        if shard.stream not in streams:
            continue  # never listed by the reader: nothing of it was read
        index, record = streams[shard.stream]
        stop = shard.count if shard.index < index else record if shard.index == index else 0
        if stop == 0:
            continue
        opened = OpenShard(epath.Path(buffer_dir), shard)
        try:
            for raw in opened.reader.read(0, stop):
                g = decode(raw)
                out.append((g.meta["worker"], str(g.prompt_id), int(g.policy_version)))
        finally:
            opened.close()
    return out


def _consumed(workdir):
    """consumed.jsonl: the last line per step (a resumed learner re-logs the steps it redid)."""
    last = {}
    for line in _jsonl(workdir / "consumed.jsonl"):
        last[line["step"]] = [tuple(g) for g in line["groups"]]
    return last


@pytest.mark.slow
def test_flow_control_bounds_how_far_workers_run_ahead(tmp_path):
    """Evaluating every step makes the learner slow: without flow control the two spawned
    workers would fill the buffer far ahead of it."""
    workdir, log = tmp_path / "run", tmp_path / "learner.log"
    steps = 4
    proc = _start(log, "--config", ASYNC, "--workdir", workdir, f"--config.train.steps={steps}",
                  "--config.eval.every=1", *COMMON)
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    finally:
        _kill_all([proc])
    text = epath.Path(log).read_text()
    assert rc == 0, text[-6000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["worker_exit_codes"] == [0, 0], summary

    c = _config()
    staleness, in_flight = c.train.max_staleness, c.rollout.max_inflight_batches
    allowed = flow.max_ahead(staleness, in_flight)  # unread batches at which a worker waits
    assert allowed <= staleness + in_flight
    batch = c.rollout.prompts_per_step // c.train.num_workers
    statuses = {s["writer_id"]: s for s in flow.read_statuses(workdir / "workers")}
    assert sorted(statuses) == ["rollout-0", "rollout-1"]
    consumed = _consumed(workdir)
    assert sorted(consumed) == list(range(1, steps + 1))
    read_from = collections.Counter(g[0] for groups in consumed.values() for g in groups)
    # Spawned workers write their lines to WORKDIR/workers/rollout-{i}.log, not the console.
    worker_logs = "".join((workdir / "workers" / f"rollout-{i}.log").read_text() for i in (0, 1))
    assert "waiting for the learner" in worker_logs, worker_logs[-6000:]
    for wid, st in statuses.items():
        assert st["state"] == "done", st
        assert st["worker/batches"] >= 1 and read_from[wid] >= 1, (wid, st, read_from)
        # The worker's own measure (after each write) ...
        assert st["worker/max_ahead"] <= allowed, st
        # ... and independently of it: what it wrote beyond what the learner read (trained on
        # or dropped as stale) is at most `allowed` batches.
        written = st["worker/groups_written"]
        assert written <= read_from[wid] + summary["stale_dropped"] + allowed * batch, (
            wid, written, read_from, summary["stale_dropped"])

    # Every group trained on at step s (the update from version s - 1) was sampled at most
    # max_staleness versions before it (never after it).
    for step, groups in consumed.items():
        assert len(groups) == c.rollout.prompts_per_step, (step, groups)
        for worker, prompt_id, version in groups:
            assert 0 <= (step - 1) - version <= staleness, (step, worker, prompt_id, version)

    # samples.jsonl: the first log.samples_per_step groups the learner read for each step,
    # as text (consumed.jsonl lists the same groups in the same order).
    k = c.log.samples_per_step
    rows = _jsonl(workdir / "samples.jsonl")
    assert sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    for step, groups in consumed.items():
        mine = [r for r in rows if r["step"] == step]
        firsts = [r for r in mine if r["sample"] == 0]
        assert [(r["group"], r["prompt_id"], r["policy_version"]) for r in firsts] == [
            (g, pid, version) for g, (_, pid, version) in enumerate(groups[:k])]
        assert all(r["prompt"] and r["outcome"] in ("correct", "wrong") for r in mine), mine
        assert all(isinstance(r["reward"], float) and r["advantage"] is not None for r in mine)
    # buffer inspect: staleness at consumption as consumed.jsonl gives it, within the bound.
    at_read = collections.Counter((step - 1) - version for step, groups in consumed.items()
                                  for _, _, version in groups)
    out = subprocess.run([sys.executable, "-m", "espo_jax.buffer", "inspect",
                          workdir / "buffer"], capture_output=True, text=True, timeout=120,
                         env=_env())
    assert out.returncode == 0, out.stderr
    histogram = ", ".join(f"{lag}: {n} groups" for lag, n in sorted(at_read.items()))
    assert (f"train.max_staleness bounds it): {histogram}\n") in out.stdout, out.stdout
    assert (f"consumed: the learner read {sum(at_read.values())} groups in RL steps 1..{steps}"
            in out.stdout), out.stdout
    assert "unless --config.buffer.keep_consumed=True" in out.stdout

    # MS-ZVE's worker-side stages (0, 1, 5) reach the learner's metrics.
    rl = [r for r in _rl_rows(workdir) if "async/staleness_max" in r]
    assert [r["step"] for r in rl] == list(range(1, steps + 1))
    for r in rl:
        assert r["async/staleness_max"] <= staleness
        assert r["zve/active"] > 0 and r["zve/samples_per_prompt"] > 0, r
        # generated (read + dropped as stale) against trained response lengths, every step
        assert min(r[f"lengths/{k}"] for k in ("generated_mean", "generated_p90",
                                                "trained_mean", "trained_p90")) > 0, r
        assert r["zve/missing_outcomes"] == 0 and r["zve/missing_outcomes_total"] == 0, r
    assert rl[-1]["zve/offline_rollouts"] > 0, rl[-1]


@pytest.mark.slow
def test_sigkill_a_worker_it_is_restarted_and_no_group_is_lost_or_doubled(tmp_path):
    workdir, log = tmp_path / "run", tmp_path / "learner.log"
    steps = 6
    proc = _start(log, "--config", ASYNC, "--workdir", workdir, f"--config.train.steps={steps}",
                  "--config.buffer.keep_consumed=True", *COMMON)
    status_file = workdir / "workers" / "rollout-0.json"
    try:
        def first_batch():
            st = flow.read_json(status_file)
            return st if st and st.get("worker/batches", 0) >= 1 else None

        st = _wait_until(first_batch, [(proc, log)], "worker 0's first batch")
        victim = int(st["pid"])
        assert victim != proc.pid
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=TIMEOUT_S)
    finally:
        _kill_all([proc])
    text = epath.Path(log).read_text()
    assert rc == 0, text[-6000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["worker_restarts"] == {"0": 1}, summary["worker_restarts"]
    assert summary["worker_exit_codes"] == [0, 0], summary  # the restarted one and worker 1
    assert "rollout worker 0 died (exit -9): restarting it (1 of" in text, text[-6000:]
    # Spawned workers write their lines to WORKDIR/workers/rollout-{i}.log, not the console.
    worker_log = (workdir / "workers" / "rollout-0.log").read_text()
    assert "resumed the prompt scheduler" in worker_log, worker_log[-6000:]
    assert flow.read_json(status_file)["pid"] != victim

    lines = _jsonl(workdir / "consumed.jsonl")
    assert [line["step"] for line in lines] == list(range(1, steps + 1))  # no learner restart
    consumed = [tuple(g) for line in lines for g in line["groups"]]
    pairs = collections.Counter((w, p) for w, p, _ in consumed)
    assert max(pairs.values()) == 1, [k for k, n in pairs.items() if n > 1]
    assert {w for w, _, _ in consumed} == {"rollout-0", "rollout-1"}

    # Every group of the shards the learner's final cursor has passed was read exactly once:
    # trained on (consumed.jsonl) or dropped as stale (counted in the summary).
    progress = flow.read_progress(workdir / "weights")
    assert progress["done"] and progress["step"] == steps
    in_shards = _buffer_groups_before(workdir / "buffer", progress["cursor"])
    written_twice = [k for k, n in collections.Counter((w, p) for w, p, _ in in_shards).items()
                     if n > 1]
    assert written_twice == []  # the restarted worker wrote no prompt's group again
    shard_set, consumed_set = collections.Counter(in_shards), collections.Counter(consumed)
    assert consumed_set - shard_set == collections.Counter()  # nothing read from nowhere
    assert summary["stale_dropped"] == len(in_shards) - len(consumed), (
        summary["stale_dropped"], len(in_shards), len(consumed))
    assert sum((shard_set - consumed_set).values()) == summary["stale_dropped"]


@pytest.mark.slow
def test_sigkill_the_learner_it_resumes_with_the_workers_still_running(tmp_path):
    workdir = tmp_path / "run"
    steps = 6
    flags = ("--config", ASYNC, "--workdir", workdir, f"--config.train.steps={steps}",
             "--config.train.num_workers=0", *COMMON)
    assert _config().checkpoint.every == 1  # a checkpoint after every step
    log1, log2 = tmp_path / "learner1.log", tmp_path / "learner2.log"
    learner = _start(log1, *flags)
    procs = [learner]
    try:
        # The workers start once version 0 is published (as launch/slurm_vllm.sbatch does):
        # by then the learner has prepared WORKDIR/data, which processes starting together
        # would race to build.
        _wait_until(lambda: weights.latest(workdir / "weights"), [(learner, log1)],
                    "weights version 0")
        workers = [(_start(tmp_path / f"worker{i}.log", *flags, "--config.mode=rollout",
                           f"--worker_index={i}", "--num_workers=2"),
                    tmp_path / f"worker{i}.log") for i in range(2)]
        procs += [p for p, _ in workers]
        _wait_until(lambda: any(r["step"] >= 2 for r in _rl_rows(workdir)),
                    [(learner, log1), *workers], "RL step 2")
        learner.kill()  # SIGKILL the learner only
        learner.wait(timeout=60)
        assert not (workdir / "summary.json").exists()
        time.sleep(2)
        for p, wlog in workers:
            assert p.poll() is None, f"worker exited {p.returncode}:\n{_tail(wlog)}"

        resumed = _start(log2, *flags)
        procs.append(resumed)
        rc = resumed.wait(timeout=TIMEOUT_S)
        text = epath.Path(log2).read_text()
        assert rc == 0, text[-6000:]
        m = re.search(r"resuming from \S*checkpoints at RL step (\d+)", text)
        assert m and 1 <= int(m.group(1)) < steps, text[-6000:]
        summary = json.loads((workdir / "summary.json").read_text())
        assert summary["steps"] == steps
        for p, wlog in workers:  # they stop when the learner's progress says done
            try:
                code = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"worker still running:\n{_tail(wlog)}") from None
            assert code == 0, _tail(wlog)
            assert "the learner's run is done: stopping" in epath.Path(wlog).read_text()
    finally:
        _kill_all(procs)

    consumed = _consumed(workdir)
    assert sorted(consumed) == list(range(1, steps + 1))
    steps_of = collections.defaultdict(set)
    for step, groups in consumed.items():
        for w, p, _ in groups:
            steps_of[(w, p)].add(step)
    assert {k: s for k, s in steps_of.items() if len(s) > 1} == {}


def test_worker_against_a_wrong_model_config_fails_fast(tmp_path):
    workdir = tmp_path / "run"
    run_config = configs.experiment_config("arith_espo", "small")
    want = run_setup.model_architecture(run_config)
    other = want.replace(n_layers=want.n_layers + 1)
    params = jax.device_get(jax.jit(models.init_params, static_argnums=0)(
        other, jax.random.key(0)))
    weights.publish(workdir / "weights", 0, other, params)
    log = tmp_path / "worker.log"
    proc = _start(log, "--config", SYNC, "--workdir", workdir, module="espo_jax.rollout.worker")
    try:
        rc = proc.wait(timeout=120)
    finally:
        _kill_all([proc])
    text = epath.Path(log).read_text()
    assert rc != 0, text[-6000:]
    assert "do not match this worker's model config" in text, text[-6000:]
    assert f"n_layers={other.n_layers!r} (the run's config: {want.n_layers!r})" in text, text
    assert "d_model=" not in text.split("do not match this worker's model config")[1][:300]
    buffer = workdir / "buffer"
    assert not buffer.exists() or list(buffer.iterdir()) == []
