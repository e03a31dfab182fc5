"""Rollout buffer: exactly-once reading, crash safety with real processes, damage handling."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from array_record.python import array_record_module
from helpers.buffer_proc import ids, make_group

from espo_jax.buffer import BufferReader, BufferWriter, list_shards, list_tmp_files, shards
from espo_jax.buffer import reader as reader_lib
from espo_jax.buffer import writer as writer_lib
from espo_jax.buffer.records import Response, RolloutGroup, encode

PROC = os.path.join(os.path.dirname(__file__), "..", "helpers", "buffer_proc.py")


def write_groups(directory, writer_id, tag, n, per_shard, policy_version=0):
    with BufferWriter(directory, writer_id, max_records_per_shard=per_shard) as w:
        for k in range(n):
            w.write(make_group(tag, k, policy_version))
    return w


def read_all(reader):
    return reader.read(10**6, timeout_s=0)


def test_write_read_order_cursor_and_determinism(tmp_path):
    w = write_groups(tmp_path, "a", tag=0, n=7, per_shard=3)  # shards of 3, 3, 1
    assert [shards.parse_shard_name(n).count for n in w.shards_written] == [3, 3, 1]
    write_groups(tmp_path, "b", tag=1, n=2, per_shard=3)  # finished after all of a's shards
    reader = BufferReader(tmp_path)
    first = reader.read(5)
    assert ids(first) == [[0, k] for k in range(5)]
    assert first[2] == make_group(0, 2)  # contents survive, not just ids
    cursor = json.loads(json.dumps(reader.cursor))
    rest = read_all(reader)
    assert ids(rest) == [[0, 5], [0, 6], [1, 0], [1, 1]]
    assert read_all(reader) == [] and reader.stats["groups_read"] == 9
    assert ids(read_all(BufferReader(tmp_path, cursor=cursor))) == ids(rest)
    as_arrays = {**cursor, "streams": {k: np.array(v) for k, v in cursor["streams"].items()}}
    assert ids(read_all(BufferReader(tmp_path, cursor=as_arrays))) == ids(rest)  # from orbax
    assert ids(read_all(BufferReader(tmp_path))) == ids(first + rest)  # same order again


def test_shard_limits(tmp_path):
    by_bytes = BufferWriter(tmp_path, "b", max_bytes_per_shard=1)  # every group overflows it
    by_age = BufferWriter(tmp_path, "t", max_seconds_per_shard=0.0)  # every group is too old
    for k in range(2):
        by_bytes.write(make_group(0, k))
        by_age.write(make_group(1, k))
    assert [s.count for s in list_shards(tmp_path)] == [1, 1, 1, 1]
    assert by_bytes.flush() is None  # nothing pending
    by_bytes.close()
    with pytest.raises(RuntimeError, match="is closed"):
        by_bytes.write(make_group(0, 2))


def test_missing_shards_reported_not_waited_for(tmp_path):
    write_groups(tmp_path, "w", tag=0, n=9, per_shard=3)
    (tmp_path / list_shards(tmp_path)[1].name).unlink()  # e.g. another reader's retention
    reader = BufferReader(tmp_path)
    assert ids(read_all(reader)) == [[0, k] for k in (0, 1, 2, 6, 7, 8)]
    assert reader.stats["missing_shards"] == 1
    assert reader.errors[0]["reason"] == "missing"


def test_compressed_shards_read_the_same(tmp_path):
    with BufferWriter(tmp_path, "z", max_records_per_shard=2, compression="zstd:3") as w:
        for k in range(3):
            w.write(make_group(4, k))
    got = read_all(BufferReader(tmp_path))
    assert got == [make_group(4, k) for k in range(3)]


def test_staleness_drops_and_counts(tmp_path):
    with BufferWriter(tmp_path, "w", max_records_per_shard=4) as w:
        for version in range(6):
            w.write(make_group(0, version, policy_version=version))
    dropped = []  # the learner logs the dropped groups' response lengths (`on_stale`)
    reader = BufferReader(tmp_path, max_staleness=2, on_stale=dropped.append)
    got = reader.read(10, timeout_s=0, policy_version=5)
    # 5 - v > 2 drops versions 0, 1, 2; keeps 3, 4, 5.
    assert [g.policy_version for g in got] == [3, 4, 5]
    assert reader.stats["stale_dropped"] == 3
    assert [g.policy_version for g in dropped] == [0, 1, 2]
    assert reader.stats["stale_dropped_tokens"] == sum(
        int(g.response_lengths.sum()) for g in dropped)
    assert len(read_all(BufferReader(tmp_path, max_staleness=2))) == 6  # no version: no drop


def test_retention_deletes_only_committed_shards(tmp_path):
    write_groups(tmp_path, "w", tag=0, n=9, per_shard=3)
    keep = BufferReader(tmp_path)
    read_all(keep)
    assert keep.commit() == 0 and len(list_shards(tmp_path)) == 3
    reader = BufferReader(tmp_path, retention="delete")
    reader.read(4)  # shard 0 consumed, shard 1 at record 1
    saved = reader.cursor
    reader.read(4)  # shard 1 and 2 consumed, but not saved
    assert reader.commit(saved) == 1  # only shard 0 is consumed as of the saved cursor
    assert [s.index for s in list_shards(tmp_path)] == [1, 2]
    resumed = BufferReader(tmp_path, cursor=saved, retention="delete")
    assert ids(read_all(resumed)) == [[0, k] for k in range(4, 9)]
    assert resumed.commit() == 2 and list_shards(tmp_path) == []


def test_read_waits_for_new_shards(tmp_path):
    reader = BufferReader(tmp_path, poll_interval_s=0.02)
    start = time.monotonic()
    assert reader.read(1, timeout_s=0.2) == []
    assert time.monotonic() - start >= 0.2

    def later():
        time.sleep(0.2)
        write_groups(tmp_path, "w", tag=3, n=3, per_shard=2)

    thread = threading.Thread(target=later)
    thread.start()
    got = reader.read(3, timeout_s=30)
    thread.join()
    assert ids(got) == [[3, 0], [3, 1], [3, 2]]


def test_failed_read_leaves_cursor_unmoved(tmp_path, monkeypatch):
    write_groups(tmp_path, "w", tag=0, n=5, per_shard=5)
    reader = BufferReader(tmp_path)
    calls = []
    real_decode = reader_lib.decode

    def flaky(raw):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("simulated")
        return real_decode(raw)

    monkeypatch.setattr(reader_lib, "decode", flaky)
    with pytest.raises(MemoryError):
        reader.read(5)
    assert ids(reader.read(5)) == [[0, k] for k in range(5)]  # groups 0, 1 not lost


def test_bucket_paths_stage_through_local_disk(tmp_path, monkeypatch):
    # ArrayRecord opens local files only: a bucket directory is staged. Force that code path
    # on a local directory: same shards, same groups.
    monkeypatch.setattr(writer_lib, "is_local", lambda path: False)
    monkeypatch.setattr(shards, "is_local", lambda path: False)
    write_groups(tmp_path, "w", tag=0, n=5, per_shard=2)
    assert [s.count for s in list_shards(tmp_path)] == [2, 2, 1]
    assert list_tmp_files(tmp_path) == []
    assert ids(read_all(BufferReader(tmp_path))) == [[0, k] for k in range(5)]


def test_tmp_files_ignored_and_cleaned(tmp_path):
    mine = tmp_path / "tmp.w.0123abcd.000000.arrayrecord"
    other_new = tmp_path / "tmp.v.0123abcd.000004.arrayrecord"
    other_old = tmp_path / "tmp.u.0123abcd.000002.arrayrecord"
    for path in (mine, other_new, other_old):
        writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
        writer.write(encode(make_group(9, 0)))  # never closed: a killed writer's file
    os.utime(other_old, (time.time() - 7200, time.time() - 7200))
    assert read_all(BufferReader(tmp_path)) == []
    w = BufferWriter(tmp_path, "w", stale_tmp_age_s=3600)
    assert sorted(w.removed_tmp) == [other_old.name, mine.name]
    assert list_tmp_files(tmp_path) == [other_new.name]


def _incompressible_groups(n, tokens):
    """Groups of uniform int32 tokens (incompressible) and uniform float logprobs."""
    rng = np.random.default_rng(5)
    return [
        RolloutGroup(
            prompt_id=k,
            prompt_tokens=np.arange(4),
            policy_version=0,
            sampler="test",
            created_at=0.0,
            responses=[Response(rng.integers(0, 2**31 - 1, tokens), rng.random(tokens))],
        )
        for k in range(n)
    ]


def test_flipped_bytes_mid_shard_skip_one_record(tmp_path):
    groups = _incompressible_groups(10, tokens=2000)  # ~16 kB per record, one chunk each
    with BufferWriter(tmp_path, "w", max_records_per_shard=10) as w:
        for g in groups:
            w.write(g)
    (shard,) = list_shards(tmp_path)
    path = tmp_path / shard.name
    data = bytearray(path.read_bytes())
    # Records lie in order from the file start, stored uncompressed (the default) plus small
    # chunk and block headers, so 42% of the raw total is inside record 4 (of 0..9).
    offset = int(0.42 * sum(len(encode(g)) for g in groups))
    for i in range(offset, offset + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    reader = BufferReader(tmp_path)
    got = read_all(reader)
    assert [g.prompt_id for g in got] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert got == groups[:4] + groups[5:]
    assert reader.stats["corrupt_records"] == 1
    (error,) = reader.errors
    assert error["file"] == shard.name and error["index"] == 4
    assert "hash mismatch" in error["reason"]


def test_truncated_shard_and_foreign_record_reported(tmp_path):
    write_groups(tmp_path, "w", tag=0, n=6, per_shard=3)
    first, second = list_shards(tmp_path)
    path = tmp_path / first.name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    # A valid ArrayRecord shard whose middle record is not a rollout record.
    name = shards.shard_name(second.finish_ns + 1, "x", "00ff", 0, 3)
    writer = array_record_module.ArrayRecordWriter(str(tmp_path / name), "group_size:1")
    for raw in (encode(make_group(1, 0)), b"garbage bytes", encode(make_group(1, 2))):
        writer.write(raw)
    writer.close()
    reader = BufferReader(tmp_path)
    assert ids(read_all(reader)) == [[0, 3], [0, 4], [0, 5], [1, 0], [1, 2]]
    assert reader.stats["corrupt_records"] == 3 + 1  # the truncated shard's 3, the foreign one
    reasons = [(e["file"], e["index"], e["reason"]) for e in reader.errors]
    assert reasons[0][:2] == (first.name, "all") and "name says 3" in reasons[0][2]
    assert reasons[1][:2] == (name, 1) and "not a rollout record" in reasons[1][2]
    out = subprocess.run(
        [sys.executable, "-m", "espo_jax.buffer", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr  # errors found
    assert "5 decodable groups in 3 shards from 2 writer sessions" in out.stdout
    assert f"{name} record 1: not a rollout record" in out.stdout
    assert "age of these groups against policy version 0 (its version minus theirs; not the " \
        "staleness at consumption" in out.stdout and "consumed.jsonl): 0: 5 groups" in out.stdout


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="writer_id must match"):
        BufferWriter(tmp_path, "has.dot")
    with pytest.raises(ValueError, match="compression must be uncompressed, snappy, zstd:N"):
        BufferWriter(tmp_path, "w", compression="gzip")
    with pytest.raises(ValueError, match="retention must be one of"):
        BufferReader(tmp_path, retention="forever")
    with pytest.raises(ValueError, match="not a rollout buffer cursor"):
        BufferReader(tmp_path, cursor={"position": 3})
    with pytest.raises(ValueError, match="is not \\[shard, record\\]"):
        BufferReader(tmp_path, cursor={"version": 1, "streams": {"w.01": [1]}})


def _start_writer(directory, writer_id, tag, n, per_shard, sleep_s):
    proc = subprocess.Popen(
        [sys.executable, PROC, "write", str(directory), writer_id, str(tag), str(n)]
        + [str(per_shard), str(sleep_s)],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout.readline() == b"ready\n"
    return proc


def test_sigkill_writer_at_random_moments(tmp_path):
    rng = random.Random(20261130)
    reader = BufferReader(tmp_path)
    tmp_left = []
    killed_mid_shard = 0
    for trial in range(20):
        before = {s.name for s in list_shards(tmp_path)}
        proc = _start_writer(tmp_path, "w", trial, n=10**6, per_shard=3, sleep_s=0.002)
        assert not set(tmp_left) & set(list_tmp_files(tmp_path))  # removed by this writer
        time.sleep(rng.uniform(0.0, 0.12))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        finished = sum(s.count for s in list_shards(tmp_path) if s.name not in before)
        tmp_left = list_tmp_files(tmp_path)
        killed_mid_shard += bool(tmp_left)
        got = read_all(reader)
        # Exactly the groups of this writer's finished shards, in order, each intact.
        assert ids(got) == [[trial, k] for k in range(finished)]
        assert all(g == make_group(trial, g.meta["k"]) for g in got)
        assert reader.stats["corrupt_records"] == 0
    # Most kills land inside a shard (the tmp file exists from its first write to its rename).
    assert killed_mid_shard >= 1 and reader.stats["groups_read"] > 0
    BufferWriter(tmp_path, "w")
    assert list_tmp_files(tmp_path) == []


def test_resume_in_a_new_process(tmp_path):
    write_groups(tmp_path, "w", tag=0, n=25, per_shard=4)
    reader = BufferReader(tmp_path)
    head = reader.read(10)  # stops inside the third shard (4 + 4 + 2)
    cursor_file = tmp_path / "cursor.json"
    cursor_file.write_text(json.dumps(reader.cursor))
    write_groups(tmp_path, "w2", tag=1, n=3, per_shard=4)  # arrives after the save
    out = tmp_path / "out.json"
    subprocess.run(
        [sys.executable, PROC, "read", str(tmp_path), str(cursor_file), str(out)],
        check=True,
        timeout=60,
    )
    tail = json.loads(out.read_text())
    assert ids(head) + tail["ids"] == [[0, k] for k in range(25)] + [[1, k] for k in range(3)]
    cursor_file.write_text(json.dumps(tail["cursor"]))
    subprocess.run(
        [sys.executable, PROC, "read", str(tmp_path), str(cursor_file), str(out)],
        check=True,
        timeout=60,
    )
    assert json.loads(out.read_text())["ids"] == []  # nothing twice


def test_two_writer_processes_and_a_reader(tmp_path):
    writers = [
        _start_writer(tmp_path, f"w{t}", t, n=40, per_shard=4, sleep_s=0.003) for t in (0, 1)
    ]
    reader = BufferReader(tmp_path, poll_interval_s=0.01)
    got = []
    read_while_writing = 0
    deadline = time.monotonic() + 90
    while len(got) < 80 and time.monotonic() < deadline:
        got += reader.read(80 - len(got), timeout_s=1.0)
        if got and any(p.poll() is None for p in writers):
            read_while_writing += 1
    assert read_while_writing > 0  # the reader really ran while the writers wrote
    for proc in writers:
        assert proc.wait(timeout=60) == 0
    got_ids = ids(got)
    assert sorted(map(tuple, got_ids)) == [(t, k) for t in (0, 1) for k in range(40)]
    for t in (0, 1):  # each writer's groups in the order written
        assert [k for tag, k in got_ids if tag == t] == list(range(40))
    # A finished directory reads in one deterministic order: shards sorted by finish time.
    expected = []
    for shard in list_shards(tmp_path):
        tag = int(shard.writer_id[1])
        expected += [[tag, shard.index * 4 + r] for r in range(shard.count)]
    assert ids(read_all(BufferReader(tmp_path))) == expected
    assert ids(read_all(BufferReader(tmp_path))) == expected
