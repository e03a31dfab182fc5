"""Tasks (`espo_jax.tasks`): `config.task` resolved to prompt splits and a reward, the built-in
ones, reasoning-gym by name, prompt files, your own module, and the errors of each."""

import json
import os
import pickle
import re
import sys

import pytest

from espo_jax import config_validation, configs, task_loading, task_prompts, tasks
from espo_jax.rewards.pool import RewardPool
from espo_jax.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _small(**overrides):
    c = configs.default_config()
    configs.apply_small(c)
    for key, value in overrides.items():
        node = c
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        node[leaf] = value
    return c


def test_step_credit_needs_arith_worked_solutions_and_stage_2(tmp_path):
    c = _small()
    assert task_loading.load_task(c, str(tmp_path), TOK).reward is tasks.arith_reward
    c.zve.tie_break.wrong_score = "step_credit"
    c.zve.tie_break.enabled = True
    config_validation.validate(c, n_devices=1)
    reward, target = tasks.reward_fn(task_loading.load_task(c, str(tmp_path), TOK))
    prompt = {"answer": "9", "solution": "a5=5,b+7=12,c-3=9#9", "tokens": [1, 2]}
    assert "tokens" not in target(prompt)
    assert reward("a5=5,b+7=12,c-3=8#8", target(prompt)) == {
        "reward": 0.0, "outcome": False, "step_credit": pytest.approx(2 / 3)}
    c.zve.tie_break.wrong_score = "partial"
    with pytest.raises(ValueError, match=r"wrong_score 'partial' is not one of \('zero'"):
        config_validation.validate(c, n_devices=1)
    c.zve.tie_break.wrong_score = "step_credit"
    c.zve.tie_break.enabled = False
    with pytest.raises(ValueError, match="needs worked solutions .* enabled=False"):
        config_validation.validate(c, n_devices=1)


# ---- reasoning-gym -----------------------------------------------------------------------------
def test_reasoning_gym_task_splits_scorer_and_levels():
    import reasoning_gym

    task = tasks.reasoning_gym_task("chain_sum", size=40, validation_size=30, test_size=30,
                                    seed=3, system_prompt="", level_key="num_terms",
                                    min_terms=2, max_terms=3, max_digits=1)
    assert task.name == "reasoning_gym:chain_sum" and len(task.train) == 40
    train_q = {p["entry"]["question"] for p in task.train}
    for split in (task.validation, task.test):  # duplicates of train questions dropped
        assert 0 < len(split) <= 30
        assert not train_q & {p["entry"]["question"] for p in split}
    # The same generator and seed as reasoning-gym's own dataset.
    ref = reasoning_gym.create_dataset("chain_sum", size=40, seed=3, min_terms=2, max_terms=3,
                                       max_digits=1)
    assert [p["answer"] for p in task.train] == [ref[i]["answer"] for i in range(40)]
    test_ref = reasoning_gym.create_dataset("chain_sum", size=30, seed=3 + 2 * 1_000_003,
                                            min_terms=2, max_terms=3, max_digits=1)
    assert task.test[0]["entry"]["question"] in [test_ref[i]["question"] for i in range(30)]
    assert {p["level"] for p in task.train} == {2, 3}  # metadata num_terms
    p = task.train[0]
    assert p["prompt"] == [{"role": "user", "content": ref[0]["question"]}]
    right, wrong = p["answer"], str(int(p["answer"]) + 1)
    # Tags first, else the last line; the scorer's value is the reward, outcome when it is 1.
    assert task.reward(p, f"thinking...\n<answer>{right}</answer>") == {"reward": 1.0,
                                                                        "outcome": True}
    assert task.reward(p, f"so it is\n{right}\n") == {"reward": 1.0, "outcome": True}
    assert task.reward(p, f"<answer>{wrong}</answer>")["outcome"] is False
    assert task.reward(p, "")["outcome"] is False
    assert task.reward(p, f"{right} is what it makes")["outcome"] is False  # not the last line
    numbers = tasks.ReasoningGymReward("chain_sum", answer_format="last_number")
    assert numbers(p, f"1 + 2 = {right}.\n") == {"reward": 1.0, "outcome": True}
    assert numbers(p, f"it is {right}, not 1,000") ["outcome"] is False
    with pytest.raises(ValueError, match="answer_format 'first' is not one of"):
        tasks.ReasoningGymReward("chain_sum", answer_format="first")
    # Picklable by name: the reward pool's processes rebuild the scorer.
    again = pickle.loads(pickle.dumps(task.reward))
    assert again(p, right) == {"reward": 1.0, "outcome": True}
    with pytest.raises(ValueError, match="system_prompt 'nope' is not one of"):
        tasks.reasoning_gym_task("chain_sum", size=2, system_prompt="nope")


def test_reasoning_gym_by_name_through_the_config(tmp_path):
    c = _small(task="reasoning_gym:basic_arithmetic",
               task_args=json.dumps({"size": 20, "validation_size": 8, "test_size": 8,
                                     "min_terms": 2, "max_terms": 2, "max_digits": 1,
                                     "system_prompt": ""}))
    c.warmstart.steps = 0
    c.train.anchor_coef = 0.0
    config_validation.validate(c, n_devices=1)
    task, splits = task_prompts.prompt_sources(c, str(tmp_path), TOK)
    assert len(splits["train"]) == 20 and len(splits["warm"]) == 20
    p = splits["train"][0]
    # Chat messages through the (character) tokenizer's template: the contents, no extra bos.
    assert p["prompt"] == task.train[0]["prompt"][0]["content"]
    assert p["tokens"] == TOK.encode(p["prompt"]) and p["prompt_id"].endswith("/train/0")
    c.task = "reasoning_gym:no_such_task"
    with pytest.raises(ValueError, match="reasoning-gym has no dataset 'no_such_task'"):
        config_validation.validate(c, n_devices=1)


# ---- prompt files ------------------------------------------------------------------------------
def test_prompt_files_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i), "level": 1 + i % 2}
            for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows[:3]), str(tmp_path / "test.parquet"))
    c = _small(task="files", task_args=json.dumps(
        {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.parquet"),
         "template": "Q: {question}", "reward": "exact"}))
    config_validation.validate(c, n_devices=1)
    task, splits = task_prompts.prompt_sources(c, str(tmp_path), TOK)
    assert [p["prompt"] for p in splits["test"]] == ["Q: 0+0=", "Q: 1+1=", "Q: 2+2="]
    assert splits["train"][5]["tokens"] == TOK.encode("Q: 5+5=", add_bos=True)
    assert [p["level"] for p in splits["train"]] == [1, 2, 1, 2, 1, 2]
    assert task.reward(splits["test"][2], "2+2=4\n4") is True
    assert task.reward(splits["test"][2], "5") is False
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object, got invalid JSON"):
        tasks.prompt_files(train=str(bad), test=str(bad))
    with pytest.raises(ValueError, match=r"train.jsonl:1: expected a 'prompt' field \(the row "
                                         r"has \['answer', 'level', 'question'\]\)"):
        tasks.prompt_files(train=str(tmp_path / "train.jsonl"), test=str(bad))
    with pytest.raises(FileNotFoundError, match="no test file"):
        tasks.prompt_files(train=str(bad), test=str(tmp_path / "nowhere.jsonl"))
    c.task_args = json.dumps({"train": str(bad)})
    with pytest.raises(ValueError, match="needs config.task_args with 'train' and 'test'"):
        config_validation.validate(c, n_devices=1)


def test_prompt_file_rows_are_checked_line_by_line(tmp_path):
    """Each fault names the file and line (blank lines counted) and what was expected, instead
    of a bare TypeError / KeyError from the rows' use."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.jsonl"
    good.write_text('{"q": "1+1", "prompt": "1+1=", "answer": "2"}\n')

    def error(text: str, **kw) -> str:
        path = tmp_path / "rows.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError) as raised:
            tasks.prompt_files(train=str(good), test=str(path), reward="exact", **kw)
        return str(raised.value)

    row = '{"q": "2+2", "answer": "4"}\n'
    assert error(row + "\n[1, 2]\n", template="{q}=") == (
        f"{tmp_path}/rows.jsonl:3: expected a JSON object, got a JSON list: '[1, 2]'")
    assert error(row + '"just text"\n', template="{q}=") == (
        f"{tmp_path}/rows.jsonl:2: expected a JSON object, got a JSON str: '\"just text\"'")
    assert error(row + '{"answer": "5"}\n', template="{q}=") == (
        f"{tmp_path}/rows.jsonl:2: expected a field 'q' (task_args template '{{q}}='); the row "
        "has ['answer']")
    assert error(row, template="{}=").startswith(  # the train file is read first
        f"{tmp_path}/good.jsonl:1: task_args template '{{}}=' cannot be filled from the row's "
        "fields ['answer', 'prompt', 'q']")
    assert error('{"prompt": 7, "answer": "7"}\n') == (
        f"{tmp_path}/rows.jsonl:1: expected field 'prompt' to be text or chat messages "
        '[{"role": ..., "content": ...}], got 7')
    assert error('{"prompt": [{"role": "user"}], "answer": "7"}\n').startswith(
        f"{tmp_path}/rows.jsonl:1: expected field 'prompt' to be text or chat messages")
    pq.write_table(pa.Table.from_pylist([{"q": "1"}, {"q": None}]), str(tmp_path / "t.parquet"))
    with pytest.raises(ValueError,
                       match=r"t.parquet: row 2: expected field 'q' to be text .*, got None"):
        tasks.prompt_files(train=str(good), test=str(tmp_path / "t.parquet"), prompt_key="q")
    chat = '{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}\n'
    (tmp_path / "chat.jsonl").write_text(chat)
    task = tasks.prompt_files(train=str(good), test=str(tmp_path / "chat.jsonl"), template="")
    assert task.test[0]["prompt"] == [{"role": "user", "content": "hi"}]


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    (tmp_path / "test.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ModuleNotFoundError, match=re.escape(
            "Parquet prompt files need the package pyarrow (not installed): pip install -e "
            "'.[parquet]'")):
        tasks.prompt_files(train=str(tmp_path / "train.jsonl"),
                           test=str(tmp_path / "test.parquet"))


# ---- your own module ---------------------------------------------------------------------------
USER_TASK = '''
from espo_jax.tasks import Task


def reward(prompt, text):
    if prompt["answer"] == "boom":
        raise ZeroDivisionError("the reward blew up")
    return {"reward": float(text.strip() == prompt["answer"]), "outcome": text.strip() ==
            prompt["answer"], "length": float(len(text))}


def make(n=4):
    train = [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(n)]
    test = [{"prompt": [{"role": "user", "content": "3*2="}], "answer": "6",
             "prompt_id": "t0"}]
    return Task(reward=reward, train=train, test=test)


def make_dupes():
    p = {"prompt": "1", "answer": "1", "prompt_id": "same"}
    return Task(reward=reward, train=[p, p], test=[p])


def not_a_task():
    return [1, 2]
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_task_mod.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_task_mod"
    sys.modules.pop("my_task_mod", None)


def test_user_task_module(tmp_path, user_module):
    c = _small(task=f"{user_module}:make", task_args='{"n": 3}')
    config_validation.validate(c, n_devices=1)
    task, splits = task_prompts.prompt_sources(c, str(tmp_path), TOK)
    assert task.name == "my_task_mod:make"
    assert [p["prompt_id"] for p in splits["train"]] == ["train/0", "train/1", "train/2"]
    assert splits["test"][0]["prompt"] == "3*2=" and splits["test"][0]["prompt_id"] == "t0"
    # The reward runs in the pool's processes (imported there by name) and sees the prompt dict.
    reward, target = tasks.reward_fn(task)
    with RewardPool(reward, num_workers=1, timeout_s=20.0) as pool:
        prompt = splits["train"][2]
        pool.submit("g", 0, "4", target(prompt))
        pool.submit("g", 1, "5", target(prompt))
        pool.submit("g", 2, "x", target({**prompt, "answer": "boom"}))
        right, wrong, failed = pool.wait_group("g", 3)
    assert (right.reward, right.outcome, right.components) == (1.0, True, {"length": 1.0})
    assert (wrong.reward, wrong.outcome) == (0.0, False)
    # A failure names its exception and carries the reward's own traceback.
    assert failed.failed and "ZeroDivisionError: the reward blew up" in failed.error
    assert 'my_task_mod.py", line' in failed.error and "in reward" in failed.error
    outcome = tasks.outcome_fn(task)
    assert outcome(splits["test"][0], "6") is True
    with pytest.raises(RuntimeError, match=r"'my_task_mod:make'.*prompt 't0'.*ZeroDivision"):
        outcome({**splits["test"][0], "answer": "boom"}, "6")


def test_user_task_errors(tmp_path, user_module):
    for spec, args, error, match in (
            ("my_task_mod:not_a_task", "{}", TypeError, "returned list, not a"),
            ("my_task_mod:nothing", "{}", ValueError, "module 'my_task_mod' has no 'nothing'"),
            ("no_such_module_xyz:make", "{}", ValueError, "cannot import 'no_such_module_xyz'"),
            ("my_task_mod:make_dupes", "{}", ValueError, "prompt_id 'same' appears twice"),
            ("my_task_mod:make", '{"m": 1}', ValueError,
             r"config.task_args key\(s\) \['m'\] are not parameters of task 'my_task_mod:make' "
             r"\(my_task_mod.make\); it accepts: n")):
        with pytest.raises(error, match=match):
            task_prompts.prompt_sources(_small(task=spec, task_args=args), str(tmp_path), TOK)
    c = _small(task=f"{user_module}:make")
    c.rollout.max_prompt_len = 3
    # "i*2=" + bos: 5 tokens (train, 4 prompts); the chat test prompt "3*2=": 4 (no bos)
    with pytest.raises(ValueError, match=r"longest prompt, train prompt 'train/0', has 5 tokens "
                       r"> rollout.max_prompt_len=3 \(5 of 5 prompts are longer\); set "
                       r"--config.rollout.max_prompt_len=5 \(or more\), or 0"):
        task_prompts.prompt_sources(c, str(tmp_path), TOK)
    for bad, match in (("not a spec", "is not ''"), ("a:b:c", "is not ''")):
        with pytest.raises(ValueError, match=match):
            config_validation.validate(_small(task=bad), n_devices=1)
    for args, match in (("[1]", "must be a JSON object"), ("{oops", "must be a JSON object"),
                        ('{"n": 1}', "given for a built-in task")):
        with pytest.raises(ValueError, match=match):
            config_validation.validate(_small(task_args=args), n_devices=1)


def test_example_task_in_experiments_runs_as_written():
    """experiments/my_task.py, the README's example of a task of your own, exactly as shipped."""
    root = os.path.join(os.path.dirname(__file__), "..", "experiments")
    sys.path.insert(0, os.path.abspath(root))
    try:
        import my_task
    finally:
        sys.path.pop(0)
    task = my_task.task(size=12)
    assert len(task.train) == 12 and len(task.validation) and len(task.test)
    p = task.train[0]
    assert task.reward(p, f"The answer is {p['answer']}.") is True
    assert task.reward(p, f"The answer is {int(p['answer']) + 1}.") is False
    assert task.reward(p, "no number") is False


def test_reasoning_gym_reward_loads_its_scorer_in_warmup():
    """The pool's workers call `warmup()` before work (imports outside the reward timeout);
    PromptReward passes it on to the task reward."""
    reward = tasks.ReasoningGymReward("basic_arithmetic")
    assert "_score" not in vars(reward)
    tasks.PromptReward(reward).warmup()
    assert callable(vars(reward)["_score"])
    tasks.PromptReward(tasks.arith_reward).warmup()  # a plain function has none: nothing to do
