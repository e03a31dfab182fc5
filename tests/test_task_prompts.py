"""A task's reward is tried before any work (`task_prompts.check_reward`): one that raises stops
the run within seconds naming the task, the prompt id and the traceback; one the process reward
pool cannot pickle gets an error pointing at `rollout.reward_backend`, and runs on "thread"."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from espo_jax import cli_errors, configs, task_prompts
from espo_jax.tokenizer import CharTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASKS = '''
from espo_jax.tasks import Task

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "prompt_id": f"p{i}"} for i in range(6)]


def typo(prompt, text):
    return text.strip() == prompt["answr"]  # every call raises KeyError


def exact(prompt, text):
    return text.strip() == prompt["answer"]


def broken():
    return Task(reward=typo, train=ROWS[:4], test=ROWS[4:])


def held_out_lacks_answers():
    return Task(reward=exact, train=ROWS[:4], test=[{"prompt": "9+1=", "prompt_id": "t9"}])


def a_lambda():
    return Task(reward=lambda prompt, text: text.strip() == prompt["answer"], train=ROWS[:4],
                test=ROWS[4:])


def returns_none():
    return Task(reward=print, train=ROWS[:4], test=ROWS[4:])
'''


class CountingTokenizer(CharTokenizer):
    """The character tokenizer, counting the prompts it encodes."""

    encoded = 0

    def encode(self, text, add_bos=False):
        CountingTokenizer.encoded += 1
        return super().encode(text, add_bos=add_bos)


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "faulty_tasks.py"
    path.write_text(TASKS)
    return str(path)


def _config(task: str):
    c = configs.experiment_config("my_task_espo", "small")
    c.task = task
    c.warmstart.steps, c.train.anchor_coef = 0, 0.0  # the rows carry no worked solutions
    return c


def test_a_reward_that_raises_is_named_before_the_prompts_are_tokenised(task_file, tmp_path):
    CountingTokenizer.encoded = 0
    spec = f"{task_file}:broken"
    with pytest.raises(RuntimeError) as raised:
        task_prompts.prompt_sources(_config(spec), str(tmp_path), CountingTokenizer())
    assert str(raised.value) == (
        f"task {spec!r}: the reward failed on train prompt 'p0' (KeyError: 'answr'), tried once "
        "on the completion '0' before any work; fix the reward or the prompts it reads (its "
        "traceback follows)")
    # raised from the reward's own exception: its frames are the user's code
    own = cli_errors.own_frames(raised.value.__cause__)
    assert 'return text.strip() == prompt["answr"]' in own  # the reward's own line
    assert own.rstrip().endswith("KeyError: 'answr'") and "espo_jax" not in own
    assert CountingTokenizer.encoded == 2  # the two probes (train, test); no split tokenised
    spec = f"{task_file}:held_out_lacks_answers"
    with pytest.raises(RuntimeError, match=f"(?s)task {spec!r}: the reward failed on test prompt "
                                           "'t9'.*KeyError: 'answer'"):
        task_prompts.prompt_sources(_config(spec), str(tmp_path), CharTokenizer())
    c = _config(f"{task_file}:returns_none")
    with pytest.raises(RuntimeError, match="(?s)train prompt 'p0'.*TypeError: reward function "
                                           "returned NoneType"):
        task_prompts.prompt_sources(c, str(tmp_path), CharTokenizer())


def test_a_reward_that_raises_stops_the_main_job_within_seconds(task_file, tmp_path):
    """The whole command: the error comes before any compilation or data preparation, in the
    time it takes Python to import JAX and the task."""
    workdir = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "espo_jax.main", "--config",
         os.path.join(REPO, "experiments", "my_task_espo.py:small"), "--workdir", str(workdir),
         f"--config.task={task_file}:broken"],
        cwd=REPO, env=dict(os.environ, JAX_LOG_COMPILES="1"), capture_output=True, text=True,
        timeout=300)
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    # one error line, then only the reward's own frames: no frame of espo_jax's
    assert f"error: task '{task_file}:broken': the reward failed on train prompt 'p0'" in out
    frames = proc.stderr.split("Traceback (your code's frames")[1]
    assert 'return text.strip() == prompt["answr"]' in frames and "KeyError: 'answr'" in frames
    assert "espo_jax" not in frames and proc.stderr.count('File "') == frames.count('File "')
    # Nothing of the model is compiled (the mesh checks' random key is the only program).
    assert set(re.findall(r"Compiling jit\((\w+)\)", out)) <= {"stage", "_threefry_seed"}, out
    assert not (workdir / "checkpoints").exists() and not (workdir / "warmstart").exists()
    assert seconds < 120, seconds  # JAX's import and the config: ~10 s on a 2-core machine


def test_an_unpicklable_reward_names_the_backend_key_or_runs_on_threads(task_file, tmp_path,
                                                                        monkeypatch):
    spec = f"{task_file}:a_lambda"
    c = _config(spec)
    assert c.rollout.reward_backend == "process"  # the default
    with pytest.raises(ValueError) as raised:
        task_prompts.prompt_sources(c, str(tmp_path), CharTokenizer())
    message = str(raised.value)
    assert message.startswith(f"task {spec!r}: its reward <function a_lambda.<locals>.<lambda>")
    assert "cannot be pickled" in message
    assert "process reward pool (config.rollout.reward_backend='process')" in message
    assert "set --config.rollout.reward_backend=thread" in message
    c.rollout.reward_backend = "thread"
    task, splits = task_prompts.prompt_sources(c, str(tmp_path), CharTokenizer())
    assert [p["prompt_id"] for p in splits["train"]] == ["p0", "p1", "p2", "p3"]
    # The single-process loop's pool runs it on threads ...
    from espo_jax.train import loop

    run = loop.SyncRun(c, str(tmp_path / "run"))
    prompt = splits["train"][2]  # "2+1=", answer "3"
    run.pool.submit("g", 0, "3", run.target_fn(prompt))
    run.pool.submit("g", 1, "4", run.target_fn(prompt))
    assert [(r.reward, r.error) for r in run.pool.wait_group("g", 2, timeout=30)] == [
        (1.0, None), (0.0, None)]
    run.pool.close()
    # ... and so does a rollout worker's (the worker's config is read, then it is stopped).
    from espo_jax.rollout import worker

    seen = {}

    def capture(wc, *args, **kwargs):
        seen["backend"] = wc.reward_backend
        raise SystemExit

    monkeypatch.setattr(worker, "RolloutWorker", capture)
    with pytest.raises(SystemExit):
        worker.main_from_config(c, str(tmp_path / "worker"))
    assert seen == {"backend": "thread"}


def test_the_reward_backend_is_validated_with_its_choices():
    from espo_jax import config_validation

    c = _config("")
    c.rollout.reward_backend = "gpu"
    with pytest.raises(ValueError, match=r"config.rollout.reward_backend='gpu' is not one of "
                                         r"\('process', 'thread'\)"):
        config_validation.validate(c, n_devices=1)
    json.dumps(c.to_dict())  # the key travels to spawned workers in the config's JSON
