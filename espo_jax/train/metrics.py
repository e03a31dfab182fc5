"""Metrics: clu metric writers (TensorBoard event files) plus a JSONL file, process 0 only."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np


def _scalar(v: Any) -> float:
    v = np.asarray(jax.device_get(v))
    return float(v.reshape(()) if v.size == 1 else v.mean())


def trim_jsonl(path: str, keep: Callable[[dict], bool]) -> int:
    """Rewrites the JSON-lines file `path` with the rows `keep` accepts, in order, and without a
    torn last line (a process killed mid-write); returns the number of lines dropped. The new
    file replaces the old in one rename: a crash while trimming leaves one or the other."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    kept = [x for x in lines if x.endswith("\n") and keep(json.loads(x))]
    if len(kept) < len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return len(lines) - len(kept)


class MetricLogger:
    """Writes flat scalar dicts to `workdir/metrics.jsonl` and TensorBoard event files."""

    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self._jsonl = None
        self._writer = None
        self.path = os.path.join(workdir, "metrics.jsonl")
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(self.path, "a")  # noqa: SIM115
        if tensorboard:
            from clu import metric_writers  # imports TensorFlow: only when writing event files

            self._writer = metric_writers.SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, Any], phase: str = "rl") -> dict[str, float]:
        scalars = {k: _scalar(v) for k, v in metrics.items()}
        if not self.enabled:
            return scalars
        record = {"step": int(step), "phase": phase}
        record.update({k: (v if math.isfinite(v) else None) for k, v in scalars.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            self._writer.write_scalars(int(step), {f"{phase}/{k}": v for k, v in scalars.items()})
        return scalars

    def trim(self, keep: Callable[[dict], bool]) -> int:
        """Drops the rows of metrics.jsonl that `keep` rejects (`trim_jsonl`; process 0) and
        goes on appending; returns the number dropped. TensorBoard's event files keep theirs
        (its readers show a step's latest value)."""
        if not self.enabled:
            return 0
        self._jsonl.close()
        dropped = trim_jsonl(self.path, keep)
        self._jsonl = open(self.path, "a")  # noqa: SIM115
        return dropped

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Markdown texts to TensorBoard's text tab (process 0; nothing without event files)."""
        if self.enabled and self._writer is not None:
            self._writer.write_texts(int(step), dict(texts))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()


def rollout_metrics(groups: Sequence[Any], rewards: Sequence[Any]) -> dict[str, float]:
    """Per-step figures of the scored groups a learner trains on (`RolloutGroup`s) and the
    rewards it trains with (one array per group: MS-ZVE's, possibly stage-2 shaped, not the
    reward function's in the records): `rollout/accuracy` (mean binary outcome),
    `rollout/reward_mean` / `rollout/reward_max` and `rollout/response_len_mean` (tokens).
    Empty input gives zeros."""
    responses = [r for g in groups for r in g.responses]
    if not responses:
        return {"rollout/accuracy": 0.0, "rollout/reward_mean": 0.0, "rollout/reward_max": 0.0,
                "rollout/response_len_mean": 0.0}
    rewards = np.concatenate([np.asarray(r, np.float32) for r in rewards]).astype(np.float64)
    if rewards.size != len(responses):
        raise ValueError(f"rollout_metrics: {rewards.size} rewards for {len(responses)} "
                         f"responses")
    outcomes = np.array([float(bool(r.outcome)) for r in responses])
    out = {
        "rollout/accuracy": float(outcomes.mean()),
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_max": float(rewards.max()),
        "rollout/response_len_mean": float(np.mean([r.length for r in responses])),
    }
    if not np.array_equal(rewards, outcomes):  # a score is mixed in (stage 2, a task's reward)
        out["reward/inversion_rate"] = inversion_rate(groups, rewards)
    return out


def inversion_rate(groups: Sequence[Any], rewards: np.ndarray) -> float:
    """Fraction of (right i, wrong j) pairs of one group with reward_j >= reward_i, over all
    groups (0 when no group mixes right and wrong); `rewards` is the groups' rewards in order.
    Every group-relative advantage (`espo_jax.rl.advantages`) is strictly increasing in the
    reward inside a group, so this is `reward_adjust.inversion_rate` of the advantages the
    learner trains on, for groups of any size."""
    pairs = inverted = 0
    start = 0
    for g in groups:
        r = rewards[start:start + len(g.responses)]
        start += len(g.responses)
        right = np.array([bool(x.outcome) for x in g.responses])
        if right.any() and not right.all():
            rr, rw = r[right][:, None], r[~right][None, :]
            pairs += rr.size * rw.size
            inverted += int((rw >= rr).sum())
    return inverted / max(pairs, 1)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
