"""What a rollout buffer directory holds (`python -m espo_jax.buffer inspect DIR`).

Per shard: writer stream, record count, bytes, bytes per record, policy versions, decode errors;
then unfinished tmp files, and staleness (current version minus each group's version) against
`--policy_version` (default: the newest version in the directory).
"""

from __future__ import annotations

import collections
from typing import Any

from etils import epath

from espo_jax.buffer.records import RecordDecodeError, decode
from espo_jax.buffer.shards import OpenShard, ShardInfo, list_shards, list_tmp_files


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


def inspect_directory(directory: epath.PathLike, policy_version: int | None = None) -> dict:
    """Figures for every shard of `directory` plus totals and a staleness histogram."""
    directory = epath.Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no rollout buffer directory at {directory}")
    shards = [inspect_shard(directory, s) for s in list_shards(directory)]
    versions = [v for s in shards for v in s["policy_versions"]]
    current = policy_version if policy_version is not None else max(versions, default=None)
    staleness = collections.Counter(current - v for v in versions) if versions else {}
    return {
        "directory": str(directory),
        "shards": shards,
        "tmp_files": list_tmp_files(directory),
        "groups": len(versions),
        "streams": len({s["stream"] for s in shards}),
        "policy_version": current,
        "staleness": dict(sorted(staleness.items())),
        "errors": [e for s in shards for e in s["errors"]],
        "bytes": sum(s["bytes"] for s in shards),
    }


def format_report(report: dict) -> str:
    """The report as Markdown (one table row per shard)."""
    lines = [
        f"rollout buffer {report['directory']}",
        "",
        "| shard | stream | index | records | bytes | bytes/record | policy versions | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in report["shards"]:
        v = s["policy_versions"]
        versions = f"{min(v)}..{max(v)}" if v else "-"
        per_record = s["bytes"] // s["records"] if s["records"] else 0
        lines.append(
            f"| {s['name']} | {s['stream']} | {s['index']} | {s['records']} | {s['bytes']} | "
            f"{per_record} | {versions} | {len(s['errors'])} |"
        )
    per_group = report["bytes"] // report["groups"] if report["groups"] else 0
    lines += [
        "",
        f"{report['groups']} decodable groups in {len(report['shards'])} shards from "
        f"{report['streams']} writer sessions, {report['bytes']} bytes ({per_group} per group)",
        f"staleness against policy version {report['policy_version']}: "
        + ", ".join(f"{k}: {n} groups" for k, n in report["staleness"].items()),
        f"unfinished tmp files (ignored by readers): {report['tmp_files'] or 'none'}",
        f"decode errors: {len(report['errors'])}",
    ]
    lines += [f"  {file} record {index}: {reason}" for file, index, reason in report["errors"]]
    return "\n".join(lines)
