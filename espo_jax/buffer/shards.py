"""Shard files of the rollout buffer: names, listing, and opening through `etils.epath`.

Finished shard: `shard.<finish_ns:020d>.<writer_id>.<session>.<index:06d>.n<count>.arrayrecord`.
Unfinished:     `tmp.<writer_id>.<session>.<index:06d>.arrayrecord` (never read).

ArrayRecord reads and writes local files only, so a shard in a bucket (any path with "://") is
staged through a local temporary directory; local and NFS paths are used in place.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import NamedTuple

from array_record.python import array_record_module
from etils import epath

# One record per chunk: random access, and damage stays within one record.
WRITER_OPTIONS = "group_size:1"
# Records are mostly token ids, log-probs and expert ids: zstd:3 saves ~14% of the bytes and
# costs ~5x the CPU of writing and reading (python -m espo_jax.bench buffer), so the default
# stores them uncompressed.
COMPRESSION_RE = re.compile(r"^(uncompressed|snappy|zstd:\d+|brotli:\d+)$")
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
WRITER_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SHARD_RE = re.compile(
    r"^shard\.(?P<finish_ns>\d{20})\.(?P<writer_id>[A-Za-z0-9_-]+)\.(?P<session>[0-9a-f]+)"
    r"\.(?P<index>\d{6,})\.n(?P<count>\d+)\.arrayrecord$"
)
TMP_RE = re.compile(r"^tmp\.(?P<writer_id>[A-Za-z0-9_-]+)\.(?P<session>[0-9a-f]+)\..*$")


class ShardInfo(NamedTuple):
    """A finished shard, parsed from its file name."""

    name: str
    finish_ns: int
    writer_id: str
    session: str
    index: int
    count: int

    @property
    def stream(self) -> str:
        """`<writer_id>.<session>`: one BufferWriter instance."""
        return f"{self.writer_id}.{self.session}"

    @property
    def sort_key(self) -> tuple[int, str, str, int]:
        """Reading order: finish time, then writer, session and index to break ties."""
        return (self.finish_ns, self.writer_id, self.session, self.index)


def writer_options(compression: str) -> str:
    """ArrayRecord writer options for `compression` ("uncompressed", "snappy", "zstd:N", ...)."""
    if not isinstance(compression, str) or not COMPRESSION_RE.match(compression):
        raise ValueError(
            f"compression must be uncompressed, snappy, zstd:N or brotli:N, got {compression!r}"
        )
    return f"{WRITER_OPTIONS},{compression}"


def shard_name(finish_ns: int, writer_id: str, session: str, index: int, count: int) -> str:
    return f"shard.{finish_ns:020d}.{writer_id}.{session}.{index:06d}.n{count}.arrayrecord"


def tmp_name(writer_id: str, session: str, index: int) -> str:
    return f"tmp.{writer_id}.{session}.{index:06d}.arrayrecord"


def parse_shard_name(name: str) -> ShardInfo | None:
    """The shard a file name describes, or None for anything else (tmp files, strangers)."""
    m = _SHARD_RE.match(name)
    if m is None:
        return None
    return ShardInfo(
        name, int(m["finish_ns"]), m["writer_id"], m["session"], int(m["index"]), int(m["count"])
    )


def list_shards(directory: epath.PathLike) -> list[ShardInfo]:
    """Finished shards of `directory` in reading order (sorted by `ShardInfo.sort_key`)."""
    directory = epath.Path(directory)
    if not directory.exists():
        return []
    shards = [s for s in map(parse_shard_name, _names(directory)) if s is not None]
    return sorted(shards, key=lambda s: s.sort_key)


def list_tmp_files(directory: epath.PathLike) -> list[str]:
    """Names of unfinished (tmp) shard files in `directory`."""
    directory = epath.Path(directory)
    return sorted(n for n in _names(directory) if TMP_RE.match(n)) if directory.exists() else []


def _names(directory: epath.Path) -> list[str]:
    return [p.name for p in directory.iterdir()]


def is_local(path: epath.Path) -> bool:
    """True for paths ArrayRecord can open directly (not a bucket URI)."""
    return "://" not in str(path)


def fsync(path: str) -> None:
    """Flushes a local file or directory to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OpenShard:
    """An ArrayRecordReader on a finished shard (staged to local disk when remote).

    Raises OSError/RuntimeError when the file is gone or ArrayRecord cannot open it.
    """

    def __init__(self, directory: epath.Path, shard: ShardInfo):
        self.shard = shard
        self._staged = None
        path = directory / shard.name
        try:
            if is_local(directory):
                local = os.fspath(path)
            else:
                self._staged = tempfile.mkdtemp()
                local = os.path.join(self._staged, shard.name)
                path.copy(epath.Path(local))
            self.reader = array_record_module.ArrayRecordReader(local, READER_OPTIONS)
        except BaseException:
            self._remove_staged()
            raise
        self.num_records = self.reader.num_records()

    def close(self) -> None:
        """Closes the file. ArrayRecord raises here again for damage already reported by reads
        (e.g. a truncated file); that is not a new problem, so it is not raised twice."""
        try:
            self.reader.close()
        except RuntimeError:
            pass
        finally:
            self._remove_staged()

    def _remove_staged(self) -> None:
        if self._staged:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None
