"""Flow control and health between the learner and its rollout workers, through small files.

    WEIGHTS/progress.json        the learner: its RL step and the reader's live cursor
    WORKDIR/workers/<id>.json    each worker: a heartbeat with its state and counters

A worker knows how many shards (one per batch) its stream has written; the learner's cursor
says how many of them it has read. The difference is how far the worker is ahead:

    ahead = shards written by this worker's stream - shards of it the learner has read

Before sampling a batch a worker waits while `ahead >= max_ahead(max_staleness, in_flight)`
= max_staleness + in_flight - 1. With one batch in flight and staleness 1 (the defaults) the
worker samples batch n+1 while the learner trains on batch n, and a batch is read at most one
policy version after the one that sampled it. Both files are written with a temporary name and
a rename, so a reader never sees half of one; everything goes through `etils.epath`, so the
directories may be a bucket.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from etils import epath

from espo_jax.buffer.shards import list_shards

PROGRESS = "progress.json"


def write_json(path: epath.PathLike, obj: Mapping[str, Any]) -> None:
    """Writes `obj` as JSON at `path` through a temporary name and a rename (atomic on local
    disks and NFS; last writer wins on a bucket)."""
    path = epath.Path(path)
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(3)}"
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def read_json(path: epath.PathLike) -> dict[str, Any] | None:
    """The JSON object at `path`, or None when there is none (yet) or it cannot be parsed."""
    try:
        return json.loads(epath.Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# ---- the learner's side ------------------------------------------------------------------------
def write_progress(weights_dir: epath.PathLike, step: int, cursor: Mapping[str, Any], *,
                   done: bool = False) -> None:
    """What the learner has consumed: RL `step` (versions published) and its reader's cursor.
    `done`: the run is over; workers that see it finish."""
    write_json(epath.Path(weights_dir) / PROGRESS,
               {"step": int(step), "cursor": dict(cursor), "done": bool(done),
                "updated_at": time.time()})


def read_progress(weights_dir: epath.PathLike) -> dict[str, Any] | None:
    return read_json(epath.Path(weights_dir) / PROGRESS)


def shards_read(progress: Mapping[str, Any] | None, stream: str) -> int:
    """Shards of `stream` the learner has read to the end (a shard it is in counts as unread)."""
    if not progress:
        return 0
    position = progress.get("cursor", {}).get("streams", {}).get(stream)
    return int(position[0]) if position else 0


def max_ahead(max_staleness: int, in_flight: int) -> int:
    """Unread shards at which a worker stops sampling (module doc)."""
    return max(max_staleness + in_flight - 1, 1)


def shard_durable(buffer_dir: epath.PathLike, progress: Mapping[str, Any] | None, stream: str,
                  index: int) -> bool:
    """Whether shard `index` of `stream` reached readers: it is listed, or the learner has read
    past it (retention may have deleted it since). Checked in that order: the learner writes its
    progress before it deletes what it read."""
    if any(s.stream == stream and s.index == index for s in list_shards(buffer_dir)):
        return True
    return shards_read(progress, stream) > index


# ---- the workers' side -------------------------------------------------------------------------
def status_path(status_dir: epath.PathLike, writer_id: str) -> epath.Path:
    return epath.Path(status_dir) / f"{writer_id}.json"


def read_statuses(status_dir: epath.PathLike) -> list[dict[str, Any]]:
    """Every worker's last status (`RolloutWorker` writes them), by writer id."""
    status_dir = epath.Path(status_dir)
    if not status_dir.exists():
        return []
    out = []
    for p in sorted(status_dir.glob("*.json")):
        if p.name.endswith(".state.json") or p.name.endswith(".pending.json"):
            continue
        status = read_json(p)
        if status and "writer_id" in status:
            out.append(status)
    return out


def live(statuses: list[Mapping[str, Any]], timeout_s: float,
         now: float | None = None) -> list[Mapping[str, Any]]:
    """Statuses updated within `timeout_s` seconds of `now` whose worker has not finished."""
    now = time.time() if now is None else now
    return [s for s in statuses
            if now - float(s.get("updated_at", 0.0)) <= timeout_s and s.get("state") != "done"]
