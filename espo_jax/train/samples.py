"""Samples you can read: a few groups of each RL step as text, in both loop layouts.

Each RL step the first `log.samples_per_step` groups the learner read for it (every refill
round, in the order read; 0 turns this off) go to `WORKDIR/samples.jsonl`, one JSON object per
response, and to TensorBoard's text tab (`samples/rl`, one Markdown table per step). Per
response: step, group index, prompt id, policy version, prompt text, completion text, the
reward function's reward, MS-ZVE's training reward (the outcome or the stage-2 tie-broken
reward), outcome ("correct" / "wrong" / "error" / "timeout", `espo_jax.buffer.text`), the
group-relative advantage and RL-ZVP sign the learner gets (`train.advantages`), length in
tokens, finish reason, and whether MS-ZVE kept the group (`kept`: false when the online filter,
stage 4, dropped it, for zero variance or as surplus) and whether its outcomes are all equal
(`zero_variance`). A dropped group has no training reward nor advantage (null).

Only the chosen groups are detokenised, and only process 0 writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from espo_jax.buffer.records import RolloutGroup
from espo_jax.buffer.text import group_rows, markdown_table
from espo_jax.train.advantages import config_advantages
from espo_jax.zve.groups import ScoredGroup, known_outcomes

COLUMNS = ("group", "prompt_id", "kept", "sample", "outcome", "reward", "train_reward",
           "advantage", "length", "prompt", "completion")


def step_samples(step: int, read: Sequence[RolloutGroup], batch: Sequence[ScoredGroup], k: int,
                 config, prompt_text: Callable, completion: Callable) -> list[dict[str, Any]]:
    """The rows of the first `k` groups of `read` (every group read for RL step `step`);
    `batch` is what MS-ZVE passed to the learner (the kept groups, with their rewards)."""
    kept = {id(sg.group): sg for sg in batch}
    rows = []
    for index, group in enumerate(read[:k]):
        scored = kept.get(id(group))
        adv = signs = None
        if scored is not None:
            adv, signs = config_advantages([group], [scored.rewards], config)
        known = known_outcomes(group)
        zero_variance = bool(known.size) and bool(np.all(known == known[0]))
        for j, row in enumerate(group_rows(group, prompt_text, completion)):
            rows.append({
                "step": int(step), "group": index, **row, "kept": scored is not None,
                "zero_variance": zero_variance,
                "train_reward": None if scored is None else float(scored.rewards[j]),
                "advantage": None if adv is None else float(adv[j]),
                "zvp_sign": None if signs is None else float(signs[j])})
    return rows


class SampleLog:
    """Writes each step's `step_samples` to `WORKDIR/samples.jsonl` and, through `logger` (a
    `train.metrics.MetricLogger`), to TensorBoard's text tab."""

    def __init__(self, workdir: str, config, tokenizer, completion: Callable, logger):
        self.k = int(config.log.samples_per_step)
        self.config, self.logger = config, logger
        self.prompt_text, self.completion = tokenizer.decode, completion
        self.path = os.path.join(workdir, "samples.jsonl")

    def write(self, step: int, read: Sequence[RolloutGroup], batch: Sequence[ScoredGroup]
              ) -> list[dict[str, Any]]:
        """Logs and returns the step's rows (none when `log.samples_per_step` is 0)."""
        if self.k <= 0 or not self.logger.enabled:
            return []
        rows = step_samples(step, read, batch, self.k, self.config, self.prompt_text,
                            self.completion)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        self.logger.write_texts(step, {"samples/rl": markdown_table(rows, COLUMNS)})
        return rows
