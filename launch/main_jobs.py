"""One main job as a subprocess, skipped when it already finished: what the launchers share.

`launch/arith_compare.py` and `launch/loss_seeds.py` import it from their own folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summary(run_dir: str) -> dict | None:
    """RUN_DIR/summary.json (the main job writes it last), or None."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_main(run_dir: str, experiment: str, run_flags: list[str], *, label: str,
             log_path: str, small: bool = False, code: str = REPO) -> dict:
    """`python -m espo_jax.main --config CODE/experiments/NAME.py[:ARG,small] --workdir RUN_DIR
    RUN_FLAGS` (EXPERIMENT: NAME or NAME:ARG; its output in `log_path`), on the package in
    `code` (`python -m` puts its working directory first on the path), unless RUN_DIR holds a
    summary; returns the summary.
    A failed job raises, naming its log."""
    done = summary(run_dir)
    if done is not None:
        print(f"[{label}] already finished", flush=True)
        return done
    name, _, arg = experiment.partition(":")  # EXPERIMENT[:ARG], e.g. smollm2_chain_sum:grpo
    arg = ",".join(filter(None, [arg, "small" if small else ""]))
    cmd = [sys.executable, "-m", "espo_jax.main", "--config",
           os.path.join(code, "experiments", f"{name}.py" + (f":{arg}" if arg else "")),
           "--workdir", run_dir, *run_flags]
    print(f"[{label}] started: {' '.join(cmd[2:])} (log: {log_path})", flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=code, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"[{label}] exited with {proc.returncode}; see {log_path}")
    result = summary(run_dir)
    split = "test" if "test_accuracy" in result else "held-out"
    print(f"[{label}] done in {time.time() - start:.0f} s: {split} accuracy "
          f"{result.get('test_accuracy', result['final_accuracy']):.3f}", flush=True)
    return result
