"""math_jsonl: answer extraction (GSM8K / MATH), offline preparation, clear errors."""

import json
import re

import pytest

from espo_jax.data.math_jsonl import (
    MathJsonl,
    extract_final_answer,
    last_boxed,
    math_jsonl_config,
    read_jsonl,
)
from espo_jax.data.tfds_offline import prepare

GSM8K = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn total 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A farm has 1,200 hens and buys 300 more. How many hens?",
     "answer": "1,200 + 300 = 1,500\n#### 1,500"},
]
MATH = [
    {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "level": "Level 2", "type": "Algebra",
     "solution": "We get $\\frac{2}{4}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$."},
    {"problem": "Simplify $\\sqrt{12}$.", "level": "Level ?", "type": "Algebra",
     "unique_id": "test/algebra/7.json",
     "solution": "First \\boxed{2\\sqrt{3}} wait, that is \\boxed{2\\sqrt{3}}."},
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_extraction_by_hand():
    assert extract_final_answer(GSM8K[0]) == "72"
    assert extract_final_answer(GSM8K[1]) == "1500"  # commas dropped
    assert extract_final_answer(MATH[0]) == "\\frac{3}{4}"
    assert extract_final_answer({"answer": "\\frac{1}{2}", "solution": "x"}) == "\\frac{1}{2}"
    assert extract_final_answer({"answer": 12}) == "12"
    assert extract_final_answer({"solution": "no box"}) is None
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b \\fbox{ 7 }") == "7"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # unbalanced


def test_prepare_and_read(tmp_path):
    cfg = math_jsonl_config(train=_write(tmp_path / "gsm.jsonl", GSM8K),
                            test=_write(tmp_path / "math.jsonl", MATH))
    src = prepare(MathJsonl, tmp_path / "data", cfg).as_data_source()
    train = sorted((src["train"][i] for i in range(2)), key=lambda r: r["prompt_id"])
    test = sorted((src["test"][i] for i in range(2)), key=lambda r: r["prompt_id"])
    assert [r["prompt_id"] for r in train] == [b"train/1", b"train/2"]  # line numbers
    assert [r["answer"] for r in train] == [b"72", b"1500"]
    assert train[0]["solution"].decode().endswith("#### 72")
    assert [r["prompt_id"] for r in test] == [b"test/1", b"test/algebra/7.json"]
    assert [r["answer"] for r in test] == [b"\\frac{3}{4}", b"2\\sqrt{3}"]
    assert [int(r["level"]) for r in test] == [2, 0]  # "Level ?" -> 0
    assert test[0]["subject"] == b"Algebra"


def test_edited_file_gets_a_new_config_name(tmp_path):
    path = tmp_path / "gsm.jsonl"
    first = math_jsonl_config(train=_write(path, GSM8K[:1]))
    second = math_jsonl_config(train=_write(path, GSM8K))
    assert first.name != second.name


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        math_jsonl_config(train=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="at least one split"):
        math_jsonl_config()
    bad = _write(tmp_path / "bad.jsonl", [GSM8K[0], {"question": "q", "answer": "no marker",
                                                     "solution": "s"}, {"problem": "p"}])
    cfg = math_jsonl_config(train=bad)
    with pytest.raises(ValueError, match=r"bad.jsonl:3: no final answer"):
        prepare(MathJsonl, tmp_path / "data", cfg)


def test_a_line_that_is_not_a_json_object_is_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(GSM8K[0]) + "\n\n[\"a\", 1]\n")
    with pytest.raises(ValueError, match=re.escape(
            f"math_jsonl: {path}:3: expected a JSON object, got a JSON list: '[\"a\", 1]'")):
        read_jsonl(str(path), "train")
    path.write_text(json.dumps(GSM8K[0]) + "\n{\"question\": \n")
    with pytest.raises(ValueError, match=re.escape(
            f"math_jsonl: {path}:2: expected a JSON object, got invalid JSON")):
        read_jsonl(str(path), "train")
