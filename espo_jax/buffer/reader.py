"""The buffer's reader: groups of every stream of a directory, exactly once, in shard order.

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
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from etils import epath

from espo_jax.buffer.records import RecordDecodeError, RolloutGroup, decode
from espo_jax.buffer.shards import OpenShard, ShardInfo, list_shards

log = logging.getLogger(__name__)

CURSOR_VERSION = 1
RETENTIONS = ("keep", "delete")


class BufferReader:
    """Reads groups from `directory` exactly once, in shard order, following new shards.

    Attributes:
      stats: counters: groups_read, stale_dropped (and their response tokens,
        stale_dropped_tokens), corrupt_records, shards_done, missing_shards, shards_deleted.
      errors: the most recent 1000 problems as dicts (file, index, reason); each is also logged.
      on_stale: called with each group dropped as stale (the learner logs their lengths).
    """

    def __init__(
        self,
        directory: epath.PathLike,
        cursor: dict[str, Any] | None = None,
        max_staleness: int | None = None,
        retention: str = "keep",
        poll_interval_s: float = 0.5,
        on_stale: Callable[[RolloutGroup], None] | None = None,
    ):
        if retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {retention!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self.directory = epath.Path(directory)
        self.max_staleness = max_staleness
        self.retention = retention
        self.poll_interval_s = poll_interval_s
        self.on_stale = on_stale
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
                    self.stats["stale_dropped_tokens"] += int(np.sum(group.response_lengths))
                    if self.on_stale is not None:
                        self.on_stale(group)
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
