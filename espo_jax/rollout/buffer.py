"""The rollout buffer: a directory of ArrayRecord shards, one encoded `RolloutGroup` per record.

Rollout workers write with `BufferWriter`; the learner reads with `BufferReader`. They meet only
at the directory (local disk, NFS, or a bucket through `etils.epath`).

Crash safety. A writer fills `tmp.<writer>.<session>.<index>.arrayrecord` (ArrayRecord option
`group_size:1`, one record per chunk), closes and fsyncs it, and renames it to its final name
`shard.<finish_ns>.<writer>.<session>.<index>.n<count>.arrayrecord`. Readers list only final
names, so they never see a shard being written (an unclosed ArrayRecord file reads as 0 records).
A writer killed mid-shard leaves a tmp file; readers ignore it and the next writer with the same
`writer_id` deletes it (any writer deletes tmp files older than `stale_tmp_age_s`). The record
count in the name lets a reader detect a truncated shard, which ArrayRecord would read as empty.

Streams. Each `BufferWriter` instance is a stream `<writer_id>.<session>` (session: creation time
plus random hex) whose shards are numbered 0, 1, 2, ... and renamed in that order. Restarting a
writer starts a new stream, so indices are never reused even when consumed shards were deleted.

Order. Shards are ordered by `(finish_ns, writer_id, session, index)`: finish time first, so a
reader following a live directory sees shards roughly as they were finished. For a given
directory that no writer is adding to, every reader from the same cursor returns the same groups
in the same order (all shards sorted by that key). A reader that follows live writers takes, each
time it needs a shard, the smallest key among the next unread shard of every stream it has
listed; a shard that is finished later with a smaller key (clock skew between hosts) is read
when it appears, so that order depends on timing, but never loses or repeats a group.

Exactly once. The cursor is `{"version": 1, "streams": {stream: [next_shard_index,
next_record]}}`: JSON-serialisable, one entry per writer session. A reader built from a saved
cursor continues exactly after the last group returned. Streams missing from the cursor start at
their lowest shard present.

Retention. With `retention="delete"`, `BufferReader.commit(cursor)` deletes every shard fully
consumed as of `cursor`; call it after the cursor has been saved (e.g. after the checkpoint), so
a crash between reading and saving can still re-read. One consuming reader per directory when
deleting.
"""

from __future__ import annotations

import collections
import copy
import logging
import numbers
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
from array_record.python import array_record_module
from etils import epath

from espo_jax.rollout.records import RecordDecodeError, RolloutGroup, decode, encode
from espo_jax.rollout.shards import (
    TMP_RE,
    WRITER_ID_RE,
    OpenShard,
    ShardInfo,
    fsync,
    is_local,
    list_shards,
    list_tmp_files,
    shard_name,
    tmp_name,
    writer_options,
)

__all__ = ["BufferReader", "BufferWriter", "ShardInfo", "list_shards", "list_tmp_files"]

log = logging.getLogger(__name__)

CURSOR_VERSION = 1
RETENTIONS = ("keep", "delete")


class BufferWriter:
    """Appends groups to shards of `directory` under the stream `<writer_id>.<session>`.

    A shard is finished (closed, fsynced, renamed, visible to readers) when it reaches
    `max_records_per_shard` records or `max_bytes_per_shard` bytes, when the oldest group in it
    is `max_seconds_per_shard` old at the next `write`, and on `flush()` / `close()`.
    `writer_id` must be unique among live writers of a directory: a new writer deletes the tmp
    files of its id, taking their writer for dead, and any tmp file older than
    `stale_tmp_age_s`. `compression`: ArrayRecord chunk compression, "uncompressed" (default),
    "snappy", "zstd:N" or "brotli:N".
    """

    def __init__(
        self,
        directory: epath.PathLike,
        writer_id: str,
        max_records_per_shard: int = 64,
        max_bytes_per_shard: int = 256 << 20,
        max_seconds_per_shard: float | None = None,
        stale_tmp_age_s: float = 24 * 3600.0,
        compression: str = "uncompressed",
    ):
        if not isinstance(writer_id, str) or not WRITER_ID_RE.match(writer_id):
            raise ValueError(f"writer_id must match {WRITER_ID_RE.pattern}, got {writer_id!r}")
        if max_records_per_shard < 1 or max_bytes_per_shard < 1:
            raise ValueError(
                f"max_records_per_shard ({max_records_per_shard}) and max_bytes_per_shard "
                f"({max_bytes_per_shard}) must be >= 1"
            )
        self._options = writer_options(compression)
        self.directory = epath.Path(directory)
        self.writer_id = writer_id
        self.session = f"{time.time_ns():016x}{secrets.token_hex(2)}"
        self.max_records_per_shard = max_records_per_shard
        self.max_bytes_per_shard = max_bytes_per_shard
        self.max_seconds_per_shard = max_seconds_per_shard
        self.shards_written: list[str] = []
        self.groups_written = 0
        self._index = 0
        self._last_finish_ns = 0
        self._writer = None
        self._local_tmp: str | None = None
        self._count = 0
        self._bytes = 0
        self._opened_at = 0.0
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self.removed_tmp = self._remove_dead_tmp(stale_tmp_age_s)

    @property
    def stream(self) -> str:
        return f"{self.writer_id}.{self.session}"

    def _remove_dead_tmp(self, stale_tmp_age_s: float) -> list[str]:
        removed = []
        now = time.time()
        for name in list_tmp_files(self.directory):
            path = self.directory / name
            try:
                dead = TMP_RE.match(name)["writer_id"] == self.writer_id
                if not dead:
                    dead = now - path.stat().mtime > stale_tmp_age_s
                if dead:
                    path.unlink()
                    removed.append(name)
            except FileNotFoundError:  # another writer removed it first
                continue
        if removed:
            log.info("writer %s removed unfinished tmp files: %s", self.writer_id, removed)
        return removed

    def _tmp_name(self) -> str:
        return tmp_name(self.writer_id, self.session, self._index)

    def write(self, group: RolloutGroup) -> None:
        """Encodes `group` (validating it) and appends it to the current shard."""
        if self._closed:
            raise RuntimeError(f"BufferWriter {self.stream} is closed")
        data = encode(group)
        if self._writer is None:
            if is_local(self.directory):
                self._local_tmp = os.fspath(self.directory / self._tmp_name())
            else:
                self._local_tmp = os.path.join(tempfile.mkdtemp(), self._tmp_name())
            self._writer = array_record_module.ArrayRecordWriter(self._local_tmp, self._options)
            self._opened_at = time.monotonic()
        self._writer.write(data)
        self._count += 1
        self._bytes += len(data)
        self.groups_written += 1
        too_old = (
            self.max_seconds_per_shard is not None
            and time.monotonic() - self._opened_at >= self.max_seconds_per_shard
        )
        if (
            self._count >= self.max_records_per_shard
            or self._bytes >= self.max_bytes_per_shard
            or too_old
        ):
            self.flush()

    def flush(self) -> str | None:
        """Finishes the current shard; returns its final name (None when it held no group)."""
        if self._writer is None:
            return None
        self._writer.close()
        self._writer = None
        finish_ns = max(time.time_ns(), self._last_finish_ns + 1)
        self._last_finish_ns = finish_ns
        final = shard_name(finish_ns, self.writer_id, self.session, self._index, self._count)
        fsync(self._local_tmp)
        if is_local(self.directory):
            os.rename(self._local_tmp, os.fspath(self.directory / final))
            fsync(os.fspath(self.directory))
        else:
            remote_tmp = self.directory / self._tmp_name()
            epath.Path(self._local_tmp).copy(remote_tmp, overwrite=True)
            remote_tmp.rename(self.directory / final)
            shutil.rmtree(os.path.dirname(self._local_tmp), ignore_errors=True)
        self.shards_written.append(final)
        self._index += 1
        self._count = 0
        self._bytes = 0
        return final

    def close(self) -> None:
        """Finishes the current shard; later writes raise."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> BufferWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BufferReader:
    """Reads groups from `directory` exactly once, in shard order, following new shards.

    Attributes:
      stats: counters: groups_read, stale_dropped, corrupt_records, shards_done, missing_shards,
        shards_deleted.
      errors: the most recent 1000 problems as dicts (file, index, reason); each is also logged.
    """

    def __init__(
        self,
        directory: epath.PathLike,
        cursor: dict[str, Any] | None = None,
        max_staleness: int | None = None,
        retention: str = "keep",
        poll_interval_s: float = 0.5,
    ):
        if retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {retention!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self.directory = epath.Path(directory)
        self.max_staleness = max_staleness
        self.retention = retention
        self.poll_interval_s = poll_interval_s
        self._streams = _parse_cursor(cursor)
        self._listing: dict[str, dict[int, ShardInfo]] = {}
        self._open: OpenShard | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self.errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)

    @property
    def cursor(self) -> dict[str, Any]:
        """JSON-serialisable position after the last group returned."""
        streams = {k: list(v) for k, v in sorted(self._streams.items())}
        return {"version": CURSOR_VERSION, "streams": streams}

    def read(
        self, max_groups: int, timeout_s: float | None = 0.0, policy_version: int | None = None
    ) -> list[RolloutGroup]:
        """Up to `max_groups` groups, waiting up to `timeout_s` seconds (None: forever) for them.

        With `policy_version` (the learner's current version) and `max_staleness`, groups with
        `policy_version - group.policy_version > max_staleness` are dropped and counted. If this
        raises, the cursor is left where it was before the call.
        """
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        saved = copy.deepcopy(self._streams)
        out: list[RolloutGroup] = []
        try:
            while len(out) < max_groups:
                shard = self._next_shard()
                if shard is None:
                    self._relist()
                    shard = self._next_shard()
                if shard is not None:
                    self._read_shard(shard, max_groups - len(out), out, policy_version)
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                time.sleep(
                    self.poll_interval_s if left is None else min(left, self.poll_interval_s)
                )
        except BaseException:
            self._streams = saved
            self._close_open()
            raise
        self.stats["groups_read"] += len(out)
        return out

    def commit(self, cursor: dict[str, Any] | None = None) -> int:
        """With retention "delete": deletes shards fully consumed as of `cursor` (default: now).

        Returns the number of shards deleted (0 with retention "keep").
        """
        if self.retention == "keep":
            return 0
        streams = self._streams if cursor is None else _parse_cursor(cursor)
        deleted = 0
        for shard in list_shards(self.directory):
            position = streams.get(shard.stream)
            if position is not None and shard.index < position[0]:
                try:
                    (self.directory / shard.name).unlink()
                    deleted += 1
                except FileNotFoundError:
                    pass
                self._listing.get(shard.stream, {}).pop(shard.index, None)
        self.stats["shards_deleted"] += deleted
        return deleted

    def close(self) -> None:
        self._close_open()

    def __enter__(self) -> BufferReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _relist(self) -> None:
        listing: dict[str, dict[int, ShardInfo]] = collections.defaultdict(dict)
        for shard in list_shards(self.directory):
            listing[shard.stream][shard.index] = shard
        self._listing = dict(listing)

    def _next_shard(self) -> ShardInfo | None:
        """The smallest-key shard among the next unread shard of each listed stream."""
        best = None
        for stream, shards in self._listing.items():
            position = self._streams.get(stream)
            if position is None:
                position = self._streams[stream] = [min(shards), 0]
            shard = shards.get(position[0])
            if shard is None:
                later = [i for i in shards if i > position[0]]
                if not later:
                    continue
                # Shard indices of a stream appear in order, so a gap means shards were deleted
                # by someone else: report the loss and go on rather than wait forever.
                first = min(later)
                self._report(f"{stream} shards {position[0]}..{first - 1}", "all", "missing")
                self.stats["missing_shards"] += first - position[0]
                position[:] = [first, 0]
                shard = shards[first]
            if best is None or shard.sort_key < best.sort_key:
                best = shard
        return best

    def _read_shard(
        self, shard: ShardInfo, wanted: int, out: list[RolloutGroup], policy_version: int | None
    ) -> None:
        """Appends up to `wanted` groups of `shard` to `out`, advancing the cursor per record."""
        position = self._streams[shard.stream]
        opened = self._reader_for(shard)
        available = 0 if opened is None else opened.num_records
        while position[1] < shard.count and wanted > 0:
            start = position[1]
            stop = min(shard.count, start + wanted, max(start, available))
            for i, raw in enumerate(self._read_range(opened, start, stop)):
                position[1] = start + i + 1
                if raw is None:
                    continue
                group = self._decode(shard, start + i, raw)
                if group is None:
                    continue
                if self._is_stale(group, policy_version):
                    self.stats["stale_dropped"] += 1
                    continue
                out.append(group)
                wanted -= 1
            if stop == start:  # the rest of the shard is missing from the file
                self.stats["corrupt_records"] += shard.count - start
                position[1] = shard.count
        if position[1] >= shard.count:
            self._close_open()
            position[:] = [shard.index + 1, 0]
            self.stats["shards_done"] += 1

    def _read_range(self, opened: OpenShard | None, start: int, stop: int) -> list:
        """Raw records [start, stop); None for each record ArrayRecord cannot read."""
        if stop <= start:
            return []
        reader = opened.reader
        try:
            return reader.read(start, stop)
        except RuntimeError:
            pass
        raws: list[bytes | None] = []
        for i in range(start, stop):
            try:
                raws.append(reader.read([i])[0])
            except RuntimeError as e:
                self._report(opened.shard.name, i, f"unreadable: {e}")
                self.stats["corrupt_records"] += 1
                raws.append(None)
        return raws

    def _decode(self, shard: ShardInfo, index: int, raw: bytes) -> RolloutGroup | None:
        try:
            return decode(raw)
        except RecordDecodeError as e:
            self._report(shard.name, index, str(e))
            self.stats["corrupt_records"] += 1
            return None

    def _is_stale(self, group: RolloutGroup, policy_version: int | None) -> bool:
        if self.max_staleness is None or policy_version is None:
            return False
        return policy_version - group.policy_version > self.max_staleness

    def _reader_for(self, shard: ShardInfo) -> OpenShard | None:
        """The open `shard`, or None (reported) when the file cannot be opened."""
        if self._open is not None and self._open.shard == shard:
            return self._open
        self._close_open()
        try:
            self._open = OpenShard(self.directory, shard)
        except (OSError, RuntimeError, ValueError) as e:
            self._report(shard.name, "all", f"cannot open: {type(e).__name__}: {e}")
            return None
        if self._open.num_records != shard.count:
            self._report(
                shard.name,
                "all",
                f"file holds {self._open.num_records} records, its name says {shard.count}: "
                "truncated or damaged index; reading what is there",
            )
        return self._open

    def _close_open(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.close()

    def _report(self, file: str, index: int | str, reason: str) -> None:
        log.warning("rollout buffer: skipping %s record %s: %s", file, index, reason)
        self.errors.append({"file": file, "index": index, "reason": reason})


def _parse_cursor(cursor: dict[str, Any] | None) -> dict[str, list[int]]:
    """Validates a saved cursor (numpy ints and arrays from a checkpoint are accepted)."""
    if cursor is None:
        return {}
    if (
        not isinstance(cursor, dict)
        or cursor.get("version") != CURSOR_VERSION
        or not isinstance(cursor.get("streams"), dict)
    ):
        raise ValueError(f"not a rollout buffer cursor (version {CURSOR_VERSION}): {cursor!r}")
    streams = {}
    for stream, position in cursor["streams"].items():
        ok = isinstance(position, (list, tuple, np.ndarray)) and len(position) == 2
        if not ok or not all(isinstance(x, numbers.Integral) and x >= 0 for x in position):
            raise ValueError(
                f"cursor stream {stream!r}: position {position!r} is not [shard, record]"
            )
        streams[stream] = [int(position[0]), int(position[1])]
    return streams


if __name__ == "__main__":
    from espo_jax.rollout.buffer_inspect import main

    sys.exit(main())
