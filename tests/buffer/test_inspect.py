"""`python -m espo_jax.buffer inspect`: what the learner consumed, the staleness at consumption
(from its consumed.jsonl), the unread groups' age, and one group's text. A real learner's buffer
and log: tests/test_experiments.py (single process), tests/train/test_worker_layout.py."""

import json
import subprocess
import sys

import numpy as np

from espo_jax.buffer import BufferReader, BufferWriter
from espo_jax.buffer.inspect import format_report, inspect_directory
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _group(k: int, version: int) -> RolloutGroup:
    """Prompt `k+1=`, answers `k+1` (right) and `0` (wrong; its reward call timed out for k=3)."""
    answers = [str(k + 1), "0"]
    responses = [Response(tokens=TOK.encode(a), logprobs=np.zeros(len(a), np.float32),
                          outcome=int(a == str(k + 1)), reward=float(a == str(k + 1)))
                 for a in answers]
    meta = {"worker": "w0"}
    if k == 3:
        meta.update(reward_failed=[1], reward_timed_out=[1])
    return RolloutGroup(prompt_id=f"p{k}", prompt_tokens=TOK.encode(f"{k}+1="),
                        policy_version=version, sampler="test", created_at=0.0, meta=meta,
                        responses=responses)


def _run_dir(tmp_path):
    """WORKDIR/buffer with 4 groups in shards of 2 (versions 0, 0, 1, 1) and WORKDIR's
    consumed.jsonl after the learner read the first 3 at its version 1 (RL step 2)."""
    buffer = tmp_path / "buffer"
    with BufferWriter(buffer, "w0", max_records_per_shard=2) as w:
        for k, version in enumerate([0, 0, 1, 1]):
            w.write(_group(k, version))
    with BufferReader(buffer) as reader:
        read = reader.read(3)
        cursor = reader.cursor
    line = {"step": 2, "learner_version": 1, "time": 0.0, "cursor": cursor,
            "groups": [["w0", g.prompt_id, g.policy_version] for g in read]}
    (tmp_path / "consumed.jsonl").write_text(json.dumps(line) + "\n")
    return buffer


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "espo_jax.buffer", "inspect", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_staleness_at_consumption_and_the_unread_groups_age(tmp_path):
    buffer = _run_dir(tmp_path)
    report = inspect_directory(buffer)  # finds WORKDIR/consumed.jsonl by itself
    # Read at version 1: two groups of version 0 (staleness 1), one of version 1 (0).
    assert report["consumed"]["staleness"] == {0: 1, 1: 2}
    assert [s["read"] for s in report["shards"]] == [2, 1]
    assert report["read_groups"] == 3 and report["unread_groups"] == 1
    assert report["unread_age"] == {0: 1}  # the unread version-1 group, against version 1
    text = format_report(report)
    assert ("staleness at consumption (the learner's policy version when it read a group minus "
            "the version that generated it; train.max_staleness bounds it): 0: 1 groups, "
            "1: 2 groups") in text
    assert "consumed: the learner read 3 groups in RL steps 2..2, the last at 1970-01-01" in text
    assert "unless --config.buffer.keep_consumed=True: 3 of the 4 groups here are consumed" in text
    assert "unread: 1 groups, their age against policy version 1: 0: 1 groups" in text

    # Without the log the numbers are only the groups' age, and say so.
    (tmp_path / "consumed.jsonl").unlink()
    text = format_report(inspect_directory(buffer))
    assert "consumed: unknown (no consumed.jsonl next to the directory" in text
    assert ("age of these groups against policy version 1 (its version minus theirs; not the "
            "staleness at consumption, which needs consumed.jsonl): 0: 2 groups, 1: 2 groups"
            ) in text


def test_cli_shows_a_groups_text_and_says_where_consumed_shards_went(tmp_path):
    buffer = _run_dir(tmp_path)
    out = _cli(buffer, "--show_group=3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "prompt 'p3', policy version 1, sampler test, 2 responses"
    assert lines[2:4] == ["prompt:", "3+1="]
    assert lines[5:7] == ["response 0: correct, reward 1, 1 tokens, finish stop", "4"]
    assert lines[8:10] == ["response 1: timeout, reward 0, 1 tokens, finish stop", "0"]

    out = _cli(buffer, "--show_group=4")
    assert out.returncode == 2 and "holds 4 groups (0..3)" in out.stderr, out.stderr
    out = _cli(buffer, "--show_group=0", "--tokenizer", tmp_path / "nope")
    assert out.returncode == 2 and "--tokenizer=" in out.stderr, out.stderr

    for shard in buffer.iterdir():  # what a learner's commit does after its checkpoint
        shard.unlink()
    out = _cli(buffer)
    assert out.returncode == 0, out.stderr
    assert ("the learner deletes the shards it consumed once a checkpoint covers them, unless "
            "--config.buffer.keep_consumed=True: no shard is left") in out.stdout
    out = _cli(buffer, "--consumed_log", tmp_path / "missing.jsonl")
    assert out.returncode == 2 and "no consumed-groups log at" in out.stderr
