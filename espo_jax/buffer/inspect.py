"""What a rollout buffer directory holds (`python -m espo_jax.buffer inspect DIR`).

Per shard: writer stream, record count, bytes, bytes per record, policy versions, how many of
its groups the learner has read, decode errors; then unfinished tmp files, what the learner
consumed and the staleness at consumption, and the age of the groups still unread. One group's
text on request (`--show_group N`, `espo_jax.buffer.text`).

What the learner consumed comes from `WORKDIR/consumed.jsonl` (next to `DIR` by default), one
line per RL step: the learner's policy version when it read the step's groups, the reader's
cursor after them and each group's generating version. Staleness at consumption is the
learner's version minus the group's, the number `train.max_staleness` bounds. The learner
deletes the shards it consumed once a checkpoint covers them, unless
`--config.buffer.keep_consumed=True`, so a finished run's buffer is usually empty.
"""

from __future__ import annotations

import collections
import datetime
import json
from typing import Any

from etils import epath

from espo_jax.buffer.records import RecordDecodeError, RolloutGroup, decode
from espo_jax.buffer.shards import OpenShard, ShardInfo, list_shards, list_tmp_files

CONSUMED_LOG = "consumed.jsonl"


def inspect_shard(directory: epath.Path, shard: ShardInfo) -> dict[str, Any]:
    """Decodes every record of `shard`: sizes, policy versions and errors (file, index, reason)."""
    path = directory / shard.name
    info: dict[str, Any] = {
        "name": shard.name,
        "stream": shard.stream,
        "index": shard.index,
        "records": shard.count,
        "bytes": path.stat().length,
        "policy_versions": [],
        "errors": [],
    }
    try:
        opened = OpenShard(directory, shard)
    except (OSError, RuntimeError, ValueError) as e:
        info["errors"].append((shard.name, "all", f"cannot open: {e}"))
        return info
    try:
        if opened.num_records != shard.count:
            info["errors"].append(
                (
                    shard.name,
                    "all",
                    f"file holds {opened.num_records} records, name says {shard.count}",
                )
            )
        for i in range(min(opened.num_records, shard.count)):
            try:
                group = decode(opened.reader.read([i])[0])
            except (RuntimeError, RecordDecodeError) as e:
                info["errors"].append((shard.name, i, str(e)))
                continue
            info["policy_versions"].append(group.policy_version)
    finally:
        opened.close()
    return info




def read_consumed_log(path: epath.PathLike) -> list[dict[str, Any]]:
    """The lines of a `consumed.jsonl`, the last one per RL step (a resumed learner logs the
    steps it redoes again), in step order."""
    last: dict[int, dict] = {}
    for n, line in enumerate(epath.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            last[int(entry["step"])] = entry
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} line {n} is not a consumed-groups line: {e}") from None
    return [last[k] for k in sorted(last)]


def _read_counts(shard: ShardInfo, cursor: dict | None) -> int | None:
    """How many of `shard`'s records lie before `cursor` (read by the learner); None without
    a cursor."""
    if cursor is None:
        return None
    position = cursor.get("streams", {}).get(shard.stream)
    if position is None:
        return 0
    index, record = position
    return shard.count if shard.index < index else record if shard.index == index else 0


def consumption(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Groups consumed, their steps, time of the last step, staleness at consumption (learner
    version minus the group's generating version: histogram) and the latest cursor."""
    staleness: collections.Counter[int] = collections.Counter()
    for e in entries:
        learner = e.get("learner_version", max(int(e["step"]) - 1, 0))
        staleness.update(int(learner) - int(g[2]) for g in e["groups"])
    last = entries[-1] if entries else {}
    return {
        "groups": sum(len(e["groups"]) for e in entries),
        "steps": [int(e["step"]) for e in entries],
        "last_time": last.get("time"),
        "staleness": dict(sorted(staleness.items())),
        "cursor": last.get("cursor"),
    }


def inspect_directory(directory: epath.PathLike, policy_version: int | None = None,
                      consumed_log: epath.PathLike | None = None) -> dict:
    """Figures for every shard of `directory` plus totals, what the learner consumed (from
    `consumed_log`, default `DIR/../consumed.jsonl` when it exists) and the age of the groups
    it has not read against `policy_version` (default: the newest version in the directory)."""
    directory = epath.Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no rollout buffer directory at {directory}")
    if consumed_log is None and (directory.parent / CONSUMED_LOG).exists():
        consumed_log = directory.parent / CONSUMED_LOG
    if consumed_log is not None and not epath.Path(consumed_log).exists():
        raise FileNotFoundError(f"no consumed-groups log at {consumed_log}")
    consumed = consumption(read_consumed_log(consumed_log)) if consumed_log else None
    cursor = consumed["cursor"] if consumed else None
    shards = []
    for s in list_shards(directory):
        info = inspect_shard(directory, s)
        info["read"] = _read_counts(s, cursor)
        shards.append(info)
    versions = [v for s in shards for v in s["policy_versions"]]
    # Unread: records at or after the cursor (all of them without a cursor).
    unread = [v for s in shards for i, v in enumerate(s["policy_versions"])
              if s["read"] is None or i >= s["read"]]
    current = policy_version if policy_version is not None else max(versions, default=None)
    age = collections.Counter(current - v for v in unread) if unread else {}
    return {
        "directory": str(directory),
        "shards": shards,
        "tmp_files": list_tmp_files(directory),
        "groups": len(versions),
        "streams": len({s["stream"] for s in shards}),
        "policy_version": current,
        "consumed_log": None if consumed_log is None else str(consumed_log),
        "consumed": consumed,
        "read_groups": (None if cursor is None
                        else sum(min(s["read"], len(s["policy_versions"])) for s in shards)),
        "unread_groups": len(unread),
        "unread_age": dict(sorted(age.items())),
        "errors": [e for s in shards for e in s["errors"]],
        "bytes": sum(s["bytes"] for s in shards),
    }


def _histogram(counts: dict) -> str:
    return ", ".join(f"{k}: {n} groups" for k, n in counts.items()) or "no groups"


def format_report(report: dict) -> str:
    """The report as Markdown (one table row per shard)."""
    lines = [
        f"rollout buffer {report['directory']}",
        "",
        "| shard | stream | index | records | bytes | bytes/record | policy versions | read by "
        "learner | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report["shards"]:
        v = s["policy_versions"]
        versions = f"{min(v)}..{max(v)}" if v else "-"
        per_record = s["bytes"] // s["records"] if s["records"] else 0
        read = "?" if s["read"] is None else f"{s['read']}/{s['records']}"
        lines.append(
            f"| {s['name']} | {s['stream']} | {s['index']} | {s['records']} | {s['bytes']} | "
            f"{per_record} | {versions} | {read} | {len(s['errors'])} |"
        )
    per_group = report["bytes"] // report["groups"] if report["groups"] else 0
    lines += [
        "",
        f"{report['groups']} decodable groups in {len(report['shards'])} shards from "
        f"{report['streams']} writer sessions, {report['bytes']} bytes ({per_group} per group)",
    ]
    lines += _consumed_lines(report)
    lines += [
        f"unfinished tmp files (ignored by readers): {report['tmp_files'] or 'none'}",
        f"decode errors: {len(report['errors'])}",
    ]
    lines += [f"  {file} record {index}: {reason}" for file, index, reason in report["errors"]]
    return "\n".join(lines)


_RETENTION = ("the learner deletes the shards it consumed once a checkpoint covers them, "
              "unless --config.buffer.keep_consumed=True")


def _consumed_lines(report: dict) -> list[str]:
    c = report["consumed"]
    if c is None:
        return [
            "consumed: unknown (no consumed.jsonl next to the directory; --consumed_log=FILE); "
            + _RETENTION + (": no shards here, none written yet or all consumed and deleted"
                            if not report["shards"] else ""),
            f"age of these groups against policy version {report['policy_version']} (its "
            "version minus theirs; not the staleness at consumption, which needs "
            f"consumed.jsonl): {_histogram(report['unread_age'])}",
        ]
    steps = c["steps"]
    when = ("" if c["last_time"] is None else ", the last at " + datetime.datetime.fromtimestamp(
        c["last_time"], datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))
    span = f"RL steps {steps[0]}..{steps[-1]}" if steps else "no step"
    kept = report["read_groups"] or 0
    lines = [
        f"consumed: the learner read {c['groups']} groups in {span}{when} "
        f"({report['consumed_log']}); {_RETENTION}: "
        + ("the log has no cursor, so which groups here are consumed is unknown"
           if report["read_groups"] is None and report["shards"] else
           f"{kept} of the {report['groups']} groups here are consumed" if kept else
           "none of the groups here is consumed" if report["shards"] else
           "no shard is left"),
        "staleness at consumption (the learner's policy version when it read a group minus "
        f"the version that generated it; train.max_staleness bounds it): "
        f"{_histogram(c['staleness'])}",
    ]
    if report["unread_groups"]:
        what = (f"unread: {report['unread_groups']} groups, their age" if report["read_groups"]
                is not None else "age of the groups here (not the staleness at consumption)")
        lines.append(f"{what} against policy version {report['policy_version']}: "
                     f"{_histogram(report['unread_age'])}")
    return lines


def find_group(directory: epath.PathLike, index: int) -> tuple[RolloutGroup, ShardInfo, int]:
    """The `index`-th group of `directory` in reading order (0-based), with its shard and its
    record index there; IndexError names how many groups the directory holds."""
    directory = epath.Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no rollout buffer directory at {directory}")
    if index < 0:
        raise IndexError(f"--show_group must be >= 0, got {index}")
    seen = 0
    for shard in list_shards(directory):
        if index < seen + shard.count:
            opened = OpenShard(directory, shard)
            try:
                raw = opened.reader.read([index - seen])[0]
            finally:
                opened.close()
            return decode(raw), shard, index - seen
        seen += shard.count
    raise IndexError(f"group {index} asked for, but {directory} holds {seen} groups "
                     f"(0..{seen - 1})" if seen else f"group {index} asked for, but "
                     f"{directory} holds no groups: " + _RETENTION)
