"""`math_jsonl`: question/answer JSONL files given by path, as a TFDS builder (ArrayRecord).

For real models and tokenizers. One JSON object per line, in either common layout:

- GSM8K: `{"question": ..., "answer": "<worked solution>\\n#### 72"}`: the final answer is the
  text after the last `####` (commas dropped: "1,000" -> "1000");
- MATH: `{"problem": ..., "solution": "... \\boxed{\\frac{1}{2}} ..."}` (optionally `"level":
  "Level 3"`, `"type"`): the final answer is the content of the last `\\boxed{}` (or `\\fbox{}`);
  an explicit `"answer"` field without `####` (MATH-500 style) is taken as the final answer.

A line whose final answer cannot be found is an error naming the file and line: a silently
dropped or empty answer would turn into rewards of 0 for every response.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re

import numpy as np
import tensorflow_datasets as tfds

from espo_jax.data.jsonl import json_objects
from espo_jax.data.tfds_offline import OfflineBuilder
from espo_jax.rewards.verifiers import last_boxed

_QUESTION_KEYS = ("question", "problem", "prompt")


@dataclasses.dataclass(eq=False, kw_only=True)
class MathJsonlConfig(tfds.core.BuilderConfig):
    """Paths of the split files. Build it with `math_jsonl_config(...)`."""

    paths: tuple[tuple[str, str], ...] = ()  # (split, path) pairs


def math_jsonl_config(train: str | None = None, test: str | None = None,
                      **more_splits: str) -> MathJsonlConfig:
    """A config for the given split files; its name is a digest of their contents, so edited
    files are prepared afresh instead of reusing stale ArrayRecords."""
    paths = {"train": train, "test": test, **more_splits}
    paths = {k: os.path.abspath(v) for k, v in paths.items() if v is not None}
    if not paths:
        raise ValueError("math_jsonl: give at least one split file (train=..., test=...)")
    digest = hashlib.sha1()
    for split, path in sorted(paths.items()):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"math_jsonl: {split} file {path} does not exist")
        with open(path, "rb") as f:
            digest.update(split.encode() + b"\0" + f.read())
    return MathJsonlConfig(name=f"h{digest.hexdigest()[:10]}",
                           paths=tuple(sorted(paths.items())))


def extract_final_answer(record: dict) -> str | None:
    """The final answer of one JSONL record (see module docstring), or None if absent."""
    answer = record.get("answer")
    if isinstance(answer, (int, float)):
        return str(answer)
    if isinstance(answer, str) and "####" in answer:
        final = answer.rsplit("####", 1)[1].strip().replace(",", "")
        return final or None
    if isinstance(answer, str) and answer.strip():
        boxed = last_boxed(answer)
        return boxed if boxed is not None else answer.strip()
    solution = record.get("solution")
    if isinstance(solution, str):
        return last_boxed(solution)
    return None


def _level(value) -> int:
    """`3`, `"3"`, `"Level 3"` -> 3; anything else (absent, "Level ?") -> 0."""
    if isinstance(value, int):
        return value
    m = re.search(r"\d+", str(value)) if value is not None else None
    return int(m.group()) if m else 0


def read_jsonl(path: str, split: str) -> list[dict]:
    """Parsed and normalised examples of one file, in file order."""
    out = []
    for line_no, record in json_objects(path, prefix="math_jsonl: "):
        where = f"math_jsonl: {path}:{line_no}"
        question = next((record[k] for k in _QUESTION_KEYS if k in record), None)
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: no question (looked for keys {_QUESTION_KEYS})")
        answer = extract_final_answer(record)
        if not answer:
            raise ValueError(f"{where}: no final answer (GSM8K '#### x' in 'answer', an "
                             "'answer' field, or \\boxed{x} in 'solution')")
        solution = record.get("solution", record.get("answer", ""))
        out.append(dict(
            prompt_id=str(record.get("id", record.get("unique_id", f"{split}/{line_no}"))),
            question=question, answer=answer, solution=str(solution),
            level=_level(record.get("level")),
            subject=str(record.get("type", record.get("subject", "")))))
    ids = [ex["prompt_id"] for ex in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"math_jsonl: {path}: id {dup!r} appears more than once")
    return out


class MathJsonl(OfflineBuilder):
    """Local math question/answer files; see the module docstring."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    # TFDS needs a default config; real uses pass `config=math_jsonl_config(...)`.
    BUILDER_CONFIGS = [MathJsonlConfig(name="unset")]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "prompt_id": tfds.features.Text(),
                "question": tfds.features.Text(),
                "answer": tfds.features.Text(),
                "solution": tfds.features.Text(),
                "level": np.int32,
                "subject": tfds.features.Text(),
            }),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # local files only
        if not self.builder_config.paths:
            raise ValueError("math_jsonl: no files; pass config=math_jsonl_config(train=..., "
                             "test=...)")
        return {split: self._generate_examples(split, path)
                for split, path in self.builder_config.paths}

    def _generate_examples(self, split: str, path: str):
        for ex in read_jsonl(path, split):
            yield ex["prompt_id"], ex
