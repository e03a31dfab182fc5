"""`rollout.max_prompt_len` sized from the task's prompts (0, the default), or checked against
every prompt when set; `task_args` checked against the task function's signature; the README's
reasoning-gym command runs as written."""

import json
import logging
import os
import re
import shlex
import subprocess
import sys

import pytest
from helpers.env import one_device_env

from espo_jax import config_validation, configs, task_loading, task_prompts
from espo_jax.tokenizer import CharTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = CharTokenizer()
TASKS = '''
from espo_jax.tasks import Task


def exact(prompt, text):
    return text.strip() == prompt["answer"]


def make(n: int = 3, long_test: int = 0):
    """Train "1+1=" .. (bos + 4 characters: 5 tokens); test "2+2=" padded to 4 + long_test
    characters (chat messages: no bos); the longest prompt is the last test one."""
    train = [{"prompt": "1+1=", "answer": "2", "prompt_id": f"tr{i}"} for i in range(n)]
    test = [{"prompt": [{"role": "user", "content": " " * k + "2+2="}], "answer": "4",
             "prompt_id": f"te{k}"} for k in range(long_test + 1)]
    return Task(reward=exact, train=train, test=test)
'''


@pytest.fixture
def task_module(tmp_path, monkeypatch):
    (tmp_path / "len_task_mod.py").write_text(TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "len_task_mod:make"
    sys.modules.pop("len_task_mod", None)


def _config(task, task_args="{}", **rollout):
    c = configs.apply_small(configs.default_config())
    c.task, c.task_args = task, task_args
    c.warmstart.steps, c.train.anchor_coef = 0, 0.0
    for key, value in rollout.items():
        c.rollout[key] = value
    return c


def test_sized_from_the_longest_prompt_and_logged(tmp_path, task_module, caplog):
    assert configs.default_config().rollout.max_prompt_len == 0  # the default: sized
    c = _config(task_module, '{"long_test": 6}')
    config_validation.validate(c)
    with caplog.at_level(logging.INFO):
        task_prompts.prompt_sources(c, str(tmp_path), TOK)
    # The longest: test prompt "te6", 6 spaces + "2+2=" = 10 tokens, rounded up to 12.
    assert c.rollout.max_prompt_len == 12
    sized = [r.getMessage() for r in caplog.records if "rollout.max_prompt_len=" in r.getMessage()]
    assert sized == ["rollout.max_prompt_len=12 from the longest prompt of task "
                     "'len_task_mod:make': test prompt 'te6', 10 tokens (rounded up to a "
                     "multiple of 4)"]
    # Sized once: the config now holds the limit, the next process checks against it.
    task_prompts.prompt_sources(c, str(tmp_path), TOK)
    assert c.rollout.max_prompt_len == 12


def test_an_explicit_limit_names_the_longest_prompt(tmp_path, task_module):
    c = _config(task_module, '{"n": 3, "long_test": 6}', max_prompt_len=7)
    # Longer than 7: test prompts te4, te5, te6 (8, 9, 10 tokens) of 3 + 7 prompts; the first
    # one over the limit is te4, but the message names the longest and the value that fits.
    with pytest.raises(ValueError) as e:
        task_prompts.prompt_sources(c, str(tmp_path), TOK)
    assert str(e.value) == (
        "task 'len_task_mod:make': its longest prompt, test prompt 'te6', has 10 tokens > "
        "rollout.max_prompt_len=7 (3 of 10 prompts are longer); set "
        "--config.rollout.max_prompt_len=10 (or more), or 0 to size it from the task's prompts")
    c.rollout.max_prompt_len = 10  # exactly the longest: accepted, kept
    task_prompts.prompt_sources(c, str(tmp_path), TOK)
    assert c.rollout.max_prompt_len == 10


def test_a_packed_row_must_hold_the_sized_row(tmp_path, task_module):
    c = _config(task_module, '{"long_test": 6}')
    c.train.pack_len = 30  # sized prompt 12 + max_new_tokens 24 - 1 = 35 > 30
    config_validation.validate(c)  # the prompt length is not known yet
    with pytest.raises(ValueError, match=r"train.pack_len = 30 is shorter than an RL row "
                       r"\(rollout.max_prompt_len \+ max_new_tokens - 1 = 35\); 0 = 70"):
        task_prompts.prompt_sources(c, str(tmp_path), TOK)


def test_the_arith_experiments_keep_their_prompt_length(tmp_path):
    """The default experiment sets 0: its longest prompt, `a1b+7c+9d-5e-9f-2=` + bos (19
    tokens: 6 labels, 6 digits, 5 signs, "="), rounds up to the 20 it set before, so its
    compiled shapes and results are unchanged (the full variant: tests/test_experiments.py
    compares the configs; its prompts are these levels' as well)."""
    c = configs.experiment_config("arith_espo", "small")
    assert c.rollout.max_prompt_len == 0
    task_prompts.prompt_sources(c, str(tmp_path), TOK)
    assert c.rollout.max_prompt_len == 20


def test_task_args_are_checked_against_the_task_function(tmp_path, task_module):
    c = _config(task_module, '{"n": 2, "size": 5}')
    with pytest.raises(ValueError, match=re.escape(
            "config.task_args key(s) ['size'] are not parameters of task 'len_task_mod:make' "
            "(len_task_mod.make); it accepts: n, long_test")):
        task_prompts.prompt_sources(c, str(tmp_path), TOK)
    # reasoning-gym: the task function's keys and the dataset's own options, at validation.
    c = _config("reasoning_gym:basic_arithmetic", '{"size": 8, "min_termz": 2}')
    with pytest.raises(ValueError) as e:
        config_validation.validate(c)
    message = str(e.value)
    assert ("config.task_args key(s) ['min_termz'] are not parameters of task "
            "'reasoning_gym:basic_arithmetic' (espo_jax.tasks.reasoning_gym_task); it accepts: "
            "size, validation_size, test_size, seed, system_prompt, level_key, answer_format, "
            "min_terms, max_terms") in message
    c.task_args = '{"size": 8, "min_terms": 2}'
    config_validation.validate(c)
    c = _config("files", '{"train": "a.jsonl", "test": "b.jsonl", "rewrd": "exact"}')
    with pytest.raises(ValueError, match=re.escape("key(s) ['rewrd'] are not parameters of "
                                                   "task 'files'")):
        config_validation.validate(c, check_paths=False)
    with pytest.raises(ValueError, match=re.escape(
            "config.task_args lacks ['test'], required by task 'x' (espo_jax.tasks."
            "prompt_files)")):
        task_loading.check_task_args(task_loading.prompt_files, {"train": "a"}, "x")


def _readme_command() -> list[str]:
    """The README's reasoning-gym command, as written (its continuation lines joined)."""
    readme = open(os.path.join(REPO, "README.md")).read().replace("\\\n", " ")
    lines = [line for line in readme.splitlines()
             if line.startswith("python -m espo_jax.main") and "reasoning_gym:" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


@pytest.mark.slow
def test_readme_reasoning_gym_command_runs(tmp_path):
    """The command on the default experiment's `:small` variant (2 RL steps) in its own
    workdir: the prompt length is sized from reasoning-gym's prompts (their system prompt is
    ~400 characters), not the arith prompts' 20."""
    command = _readme_command()
    assert "--config.task=reasoning_gym:basic_arithmetic" in command
    at = command.index("--config")
    assert command[at + 1] == "experiments/arith_espo.py"
    command[at + 1] += ":small"
    command[command.index("--workdir") + 1] = str(tmp_path)
    env = one_device_env()
    subprocess.run([sys.executable, *command[1:]], cwd=REPO, env=env, check=True, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(tmp_path / "summary.json") as f:
        assert json.load(f)["steps"] == 2
    # The reward processes load reasoning-gym in `warmup()`, outside the default 5 s timeout
    # (inside it, a loaded 2-core machine timed out several first calls).
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    failed = [r.get("reward/failed", 0) for r in rows if "reward/scored" in r]
    assert failed and not any(failed), failed
    log = open(tmp_path / "log.txt").read()
    sized = re.search(r"rollout.max_prompt_len=(\d+) from the longest prompt of task "
                      r"'reasoning_gym:basic_arithmetic': \w+ prompt '[^']+', (\d+) tokens", log)
    assert sized, log[-2000:]
    limit, longest = int(sized.group(1)), int(sized.group(2))
    assert longest > 400 and limit == -(-longest // 4) * 4
