"""`espo_jax.run_record` in process, on its own files: when a run counts as finished, what a
second start may change, and how config.json keeps its history. The main job's use of it (real
runs, the console): tests/test_main.py."""

import json

import pytest

from espo_jax import configs, run_record


def _config(**train):
    c = configs.apply_small(configs.default_config())
    for key, value in train.items():
        c.train[key] = value
    return c


def _summary(workdir, steps, tokens):
    (workdir / "summary.json").write_text(json.dumps({"steps": steps,
                                                      "generated_tokens": tokens}))


def test_finished_means_the_steps_or_the_token_budget_are_spent(tmp_path):
    assert run_record.finished_summary(_config(steps=10), str(tmp_path)) is None  # no summary
    _summary(tmp_path, steps=6, tokens=5000)
    assert run_record.finished_summary(_config(steps=10), str(tmp_path)) is None
    assert run_record.finished_summary(_config(steps=6), str(tmp_path)) == str(
        tmp_path / "summary.json")
    # `train.max_tokens`: stopped at step 6 of 10 with 5000 tokens spent of a 4000 budget
    assert run_record.finished_summary(_config(steps=10, max_tokens=4000), str(tmp_path))
    assert run_record.finished_summary(_config(steps=10, max_tokens=8000), str(tmp_path)) is None


def test_run_length_keys_change_freely_and_the_history_keeps_each_start(tmp_path, capsys):
    workdir = str(tmp_path)
    assert run_record.start(_config(steps=2), workdir, ["main.py"]) is None
    first = json.loads((tmp_path / "config.json").read_text())
    assert "plumbing check" in capsys.readouterr().out  # apply_small's banner
    longer = _config(steps=5)
    longer.checkpoint.every = 2
    assert run_record.start(longer, workdir, ["main.py"]) is None
    second = json.loads((tmp_path / "config.json").read_text())
    assert second["changes"] == {"checkpoint.every": {"old": 1, "new": 2},
                                 "train.steps": {"old": 2, "new": 5}}
    assert second["history"] == [first]
    run_record.start(longer, workdir, ["main.py"])  # the same config again: recorded too
    third = json.loads((tmp_path / "config.json").read_text())
    assert third["changes"] == {} and third["history"] == [first, {
        k: v for k, v in second.items() if k != "history"}]


def test_a_refused_change_names_every_key_and_writes_nothing(tmp_path):
    workdir, first = str(tmp_path), _config()
    run_record.start(first, workdir, ["main.py"])
    stored = (tmp_path / "config.json").read_bytes()
    # A config.json from code that had a key this code lacks, and one this code adds.
    record = json.loads(stored)
    record["config"]["train"]["old_knob"] = 3
    del record["config"]["eval"]["pass_k"]
    (tmp_path / "config.json").write_text(json.dumps(record))
    changed = _config(steps=7)
    changed.optim.lr, changed.loss.name = 0.5, "grpo"
    with pytest.raises(run_record.ConfigChangedError) as e:
        run_record.start(changed, workdir, ["main.py"])
    lines = str(e.value).splitlines()
    assert lines[0].endswith("; 4 key(s) differ:")
    assert lines[1:5] == [f"  eval.pass_k: (absent) -> {first.eval.pass_k}",
                          f'  loss.name: "{first.loss.name}" -> "grpo"',
                          f"  optim.lr: {first.optim.lr} -> 0.5", "  train.old_knob: 3 -> (absent)"]
    assert json.loads((tmp_path / "config.json").read_text()) == record  # untouched
    run_record.start(changed, workdir, ["main.py"], allow_change=True)
    kept = json.loads((tmp_path / "config.json").read_text())
    assert set(kept["changes"]) == {"eval.pass_k", "loss.name", "optim.lr", "train.old_knob",
                                    "train.steps"}
    assert kept["history"] == [record]
