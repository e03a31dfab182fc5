"""Prompt sources: tokenised prompt dicts from prepared splits, level filters, limits."""

import json

import pytest

from espo_jax.data.arith_chains import arith_chains_config
from espo_jax.data.math_jsonl import math_jsonl_config
from espo_jax.data.prompts import arith_chains_source, math_jsonl_source
from espo_jax.tokenizer import CharTokenizer

CONFIG = arith_chains_config(levels=((2, 1), (3, 2)), train_per_level=30, test_per_level=10,
                             seed=5)
TOK = CharTokenizer()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prompts")


def test_arith_prompt_dicts(data_dir):
    src = arith_chains_source(data_dir, "train", TOK, config=CONFIG)
    assert len(src) == 60  # 30 per level, both levels have that many
    p = src[0]
    assert set(p) == {"prompt_id", "prompt", "tokens", "answer", "level", "solution"}
    assert p["tokens"][0] == TOK.bos_id and len(p["tokens"]) == len(p["prompt"]) + 1
    assert TOK.decode(p["tokens"]) == p["prompt"]
    assert p["prompt_id"] == f"L{p['level']}:{p['prompt']}"
    # the same split read again gives the same prompts in the same order
    again = arith_chains_source(data_dir, "train", TOK, config=CONFIG)
    assert [q["prompt_id"] for q in again] == [q["prompt_id"] for q in src]


def test_default_config(tmp_path):
    """The default levels (what experiments use when they pass no config)."""
    src = arith_chains_source(tmp_path, "test", TOK)
    levels = [p["level"] for p in src]
    # levels 2-5 give the 200 asked for; level 1 (200 problems) holds out only those whose hash
    # lands in the test tenth, fewer than 200
    assert [levels.count(k) for k in (2, 3, 4, 5)] == [200] * 4
    assert 5 < levels.count(1) < 50
    assert max(len(p["prompt"]) + len(p["solution"]) for p in src) <= 64


def test_level_filter(data_dir):
    hard = arith_chains_source(data_dir, "test", TOK, config=CONFIG, levels=[2])
    assert len(hard) == 10 and {p["level"] for p in hard} == {2}
    with pytest.raises(ValueError, match=r"no records at levels \[7\]"):
        arith_chains_source(data_dir, "test", TOK, config=CONFIG, levels=[7])
    with pytest.raises(ValueError, match="no split 'valid'"):
        arith_chains_source(data_dir, "valid", TOK, config=CONFIG)


def test_math_template_and_length_limit(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "What is 1+1?", "answer": "so\n#### 2"}) + "\n")
    cfg = math_jsonl_config(train=str(path))
    src = math_jsonl_source(tmp_path / "d", "train", TOK, config=cfg, template="Q: {question}\nA:")
    assert src[0]["prompt"] == "Q: What is 1+1?\nA:" and src[0]["answer"] == "2"
    assert src[0]["level"] == 0 and src[0]["solution"] == "so\n#### 2"
    too_short = math_jsonl_source(tmp_path / "d", "train", TOK, config=cfg, max_prompt_tokens=5)
    with pytest.raises(ValueError, match="train/1.*> max_prompt_tokens=5"):
        too_short[0]
