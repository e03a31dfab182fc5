"""`launch/async_local.sh` at small size: a learner and 2 rollout worker processes meet at the
buffer and published-weights directories, respect the staleness limit, and shut down cleanly.
Real processes: the script, the learner, the spawned workers and their reward pools."""

import json
import os
import subprocess

import pytest
from helpers.env import one_device_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_STALENESS = 1


@pytest.mark.slow
def test_async_local_runs_and_ends_cleanly(tmp_path):
    workdir = tmp_path / "run"
    env = one_device_env()  # one CPU device
    env.update(WORKDIR=str(workdir), NUM_WORKERS="2", TIMEOUT_S="900", PYTHON="python")
    proc = subprocess.run(
        ["bash", "launch/async_local.sh", "--config.train.steps=3",
         f"--config.train.max_staleness={MAX_STALENESS}", "--config.eval.pass_k=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["worker_exit_codes"] == [0, 0]  # SIGTERM -> clean exit, no kill
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl" and "async/staleness_max" in r]
    assert [r["step"] for r in rl] == [1, 2, 3]
    # Every group trained on was sampled at most MAX_STALENESS policy versions before the
    # update that used it; older ones were dropped by the reader (and counted).
    assert max(r["async/staleness_max"] for r in rl) <= MAX_STALENESS
    for r in rl:  # the step's time, split into waiting for groups, the update and publishing
        parts = r["time/wait_s"] + r["time/update_s"] + r["time/publish_s"]
        assert min(r["time/wait_s"], r["time/publish_s"]) >= 0 and r["time/update_s"] > 0
        assert abs(parts - r["time/step_s"]) < 1e-3
    versions = sorted(os.listdir(workdir / "weights"))
    assert versions[-1] == "v00000003"  # the learner published after each update
    leftover = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes left running: {leftover.stdout}"
