"""The buffer's writer: appends encoded `RolloutGroup`s to ArrayRecord shards of one stream.

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
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import time

from array_record.python import array_record_module
from etils import epath

from espo_jax.buffer.records import RolloutGroup, encode
from espo_jax.buffer.shards import (
    TMP_RE,
    WRITER_ID_RE,
    fsync,
    is_local,
    list_tmp_files,
    shard_name,
    tmp_name,
    writer_options,
)

log = logging.getLogger(__name__)


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
