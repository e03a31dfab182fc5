"""A rollout group as rows a person reads: prompt text, each completion, its reward and outcome.

The record holds tokens only; the caller passes the detokenisers (`prompt_text`, `completion`),
so this module needs no tokenizer. Used by `python -m espo_jax.buffer inspect --show_group` and
by the learner's per-step samples (`espo_jax.train.samples`): the same fields in both.

Outcome labels: "correct" and "wrong" (the verified binary outcome), "error" and "timeout" for a
response whose reward call failed (the reward function raised or crashed its process, or ran
past `rollout.reward_timeout_s`; both count in `reward/failed`). Their indices travel in the
group's meta (`reward_failed`, `reward_timed_out`, written by `espo_jax.rollout.generate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from espo_jax.buffer.records import RolloutGroup

OUTCOMES = ("correct", "wrong", "error", "timeout")


def outcome_labels(group: RolloutGroup) -> list[str]:
    """One of `OUTCOMES` per response ("unscored" where the outcome is still None)."""
    failed = set(group.meta.get("reward_failed", []))
    timed_out = set(group.meta.get("reward_timed_out", []))
    labels = []
    for i, r in enumerate(group.responses):
        if i in timed_out:
            labels.append("timeout")
        elif i in failed:
            labels.append("error")
        elif r.outcome is None:
            labels.append("unscored")
        else:
            labels.append("correct" if r.outcome else "wrong")
    return labels


def group_rows(group: RolloutGroup, prompt_text: Callable[[Sequence[int]], str],
               completion: Callable[[Sequence[int]], str]) -> list[dict[str, Any]]:
    """One JSON-able dict per response: prompt id and text, policy version, sample index,
    completion text, the reward function's reward, outcome label, length (tokens), finish
    reason. `prompt_text` and `completion` map token ids to text."""
    prompt = prompt_text(group.prompt_tokens.tolist())
    return [
        {"prompt_id": str(group.prompt_id), "policy_version": int(group.policy_version),
         "prompt": prompt, "sample": j, "completion": completion(r.tokens.tolist()),
         "reward": None if r.reward is None else float(r.reward), "outcome": label,
         "length": r.length, "finish_reason": r.finish_reason}
        for j, (r, label) in enumerate(zip(group.responses, outcome_labels(group), strict=True))
    ]


def _cell(value: Any) -> str:
    """A Markdown table cell: pipes escaped, newlines shown as `\\n`."""
    if value is None:
        return "-"
    if isinstance(value, float):
        value = f"{value:.4g}"
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """`rows` as a Markdown table of `columns` (a missing key shows as `-`)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def format_group(group: RolloutGroup, rows: Sequence[dict[str, Any]]) -> str:
    """A group and its `group_rows` as text: a header, the prompt, then one block per
    response (outcome, reward, length, finish reason, then the completion)."""
    lines = [f"prompt {group.prompt_id!r}, policy version {group.policy_version}, sampler "
             f"{group.sampler}, {group.num_responses} responses", "prompt:",
             rows[0]["prompt"] if rows else "", ""]
    for row in rows:
        reward = "-" if row["reward"] is None else f"{row['reward']:.4g}"
        lines += [f"response {row['sample']}: {row['outcome']}, reward {reward}, "
                  f"{row['length']} tokens, finish {row['finish_reason']}",
                  row["completion"], ""]
    return "\n".join(lines)
