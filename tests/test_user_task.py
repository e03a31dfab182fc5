"""A task of your own through the main job: a module written outside the package, on
PYTHONPATH, trains for two RL steps with `--config.task=module:function`, in the single-process
loop and in the worker layout, with rewards from its function; a reward that raises is counted
and logged with the task, the prompt id and the traceback."""

import json
import os
import subprocess
import sys

import pytest
from helpers.env import one_device_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASK_MODULE = '''
import os

from espo_jax.tasks import Task


def reward(prompt, text):
    with open(os.environ["UTASK_CALLS"], "a") as f:
        f.write(prompt["prompt_id"] + "\\n")
    if prompt["prompt_id"] == "u3":
        raise ZeroDivisionError("u3 has no reward")
    return text.strip().endswith(prompt["answer"])


def make(n=12):
    train = [{"prompt": f"{i}+1=", "answer": str(i + 1), "prompt_id": f"u{i}"}
             for i in range(n)]
    test = [{"prompt": f"{i}+2=", "answer": str(i + 2), "prompt_id": f"t{i}"} for i in range(4)]
    return Task(reward=reward, train=train, test=test)
'''

LAYOUTS = {"sync": "arith_espo.py:small", "worker": "arith_espo_async.py:small"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_user_task_trains_two_steps_in_both_layouts(tmp_path, layout):
    (tmp_path / "utask.py").write_text(TASK_MODULE)
    calls = tmp_path / "calls.txt"
    env = one_device_env()
    env.update(PYTHONPATH=str(tmp_path), UTASK_CALLS=str(calls), PYTHONUNBUFFERED="1")
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "espo_jax.main", "--config",
         os.path.join(REPO, "experiments", LAYOUTS[layout]), "--workdir", str(workdir),
         "--config.task=utask:make", '--config.task_args={"n": 12}',
         "--config.warmstart.steps=0", "--config.train.anchor_coef=0", "--config.eval.pass_k=0",
         "--config.zve.tie_break.wrong_score=zero",
         "--config.eval.num_prompts=4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 2
    # Every reward came from the module's function: its log holds only its own prompt ids,
    # training prompts (scored in the pool) and the 4 test prompts (held-out evaluation,
    # twice: before and after RL), and the tries before any work (`task_prompts.check_reward`)
    # on u0 and t0 in every process that builds the task: the learner and its 2 workers.
    ids = calls.read_text().split()
    train_ids, test_ids = {f"u{i}" for i in range(12)}, {f"t{i}" for i in range(4)}
    assert set(ids) <= train_ids | test_ids
    processes = 1 if layout == "sync" else 1 + 2
    assert sum(i in test_ids for i in ids) == 2 * 4 + processes
    assert ids[:2] == ["u0", "t0"]  # the learner's tries come first
    # 2 steps x 4 prompts x 4 samples at least, plus stage 0's pass over the training prompts.
    assert sum(i in train_ids for i in ids) >= 2 * 4 * 4 + 12
    # u3's reward raises: counted, and logged with the task, the prompt id and its traceback.
    assert "task 'utask:make': reward failed on" in out and "of prompt 'u3'" in out
    assert "ZeroDivisionError: u3 has no reward" in out and 'utask.py", line' in out
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    failed = max(r.get("reward/failed", 0.0) for r in records)
    assert failed >= 1
