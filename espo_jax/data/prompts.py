"""Prompt sources: a prepared split turned into tokenised prompt dicts for the scheduler.

A prompt dict has the keys

    prompt_id  str        stable across runs (the scheduler's history is keyed by it)
    prompt     str        the text the model sees
    tokens     list[int]  `tokenizer.encode(prompt, add_bos=True)`
    answer     str        the final answer the verifier checks against
    level      int        difficulty level (0 when the source has none)
    solution   str        a worked solution (the supervised warm-start target; may be "")

Reading goes through `as_data_source()` (ArrayRecord random access, no TensorFlow).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from espo_jax.data.arith_chains import ArithChains, ArithChainsConfig, arith_chains_config
from espo_jax.data.math_jsonl import MathJsonl, MathJsonlConfig
from espo_jax.data.tfds_offline import prepare

# `{question}` is replaced by the question text of a math_jsonl record.
DEFAULT_MATH_TEMPLATE = (
    "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.\n")


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class PromptSource(Sequence):
    """Random-access prompt dicts over one split of a prepared builder.

    Args:
      records: a random-access sequence of raw records (`builder.as_data_source()[split]`).
      tokenizer: anything with `encode(text, add_bos=...)` (espo_jax.tokenizer).
      template: for math_jsonl records, the prompt text `template.format(question=...)`;
        ignored for records that carry a ready `prompt` (arith_chains).
      levels: keep only these difficulty levels (None keeps all).
      max_prompt_tokens: a prompt longer than this is an error naming it (None: no limit).
    """

    def __init__(self, records: Sequence[dict], tokenizer, *, template: str | None = None,
                 levels: Iterable[int] | None = None, max_prompt_tokens: int | None = None):
        self._records = records
        self._tokenizer = tokenizer
        self._template = template or DEFAULT_MATH_TEMPLATE
        self._max_tokens = max_prompt_tokens
        if levels is None:
            self._index = list(range(len(records)))
        else:
            wanted = set(int(x) for x in levels)
            self._index = [i for i in range(len(records)) if int(records[i]["level"]) in wanted]
            if not self._index:
                raise ValueError(f"PromptSource: no records at levels {sorted(wanted)}")

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        record = self._records[self._index[i]]
        if "prompt" in record:
            prompt = _text(record["prompt"])
        else:
            prompt = self._template.format(question=_text(record["question"]))
        tokens = self._tokenizer.encode(prompt, add_bos=True)
        if self._max_tokens is not None and len(tokens) > self._max_tokens:
            raise ValueError(f"PromptSource: prompt {_text(record['prompt_id'])!r} has "
                             f"{len(tokens)} tokens > max_prompt_tokens={self._max_tokens}")
        return dict(prompt_id=_text(record["prompt_id"]), prompt=prompt, tokens=tokens,
                    answer=_text(record["answer"]), level=int(record["level"]),
                    solution=_text(record["solution"]))

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))


def arith_chains_source(data_dir: str | os.PathLike, split: str, tokenizer, *,
                        config: ArithChainsConfig | None = None,
                        levels: Iterable[int] | None = None) -> PromptSource:
    """Prepares `arith_chains` under `data_dir` if needed and returns one split's prompts."""
    builder = prepare(ArithChains, data_dir, config or arith_chains_config())
    return PromptSource(_split(builder, split), tokenizer, levels=levels)


def math_jsonl_source(data_dir: str | os.PathLike, split: str, tokenizer, *,
                      config: MathJsonlConfig, template: str | None = None,
                      levels: Iterable[int] | None = None,
                      max_prompt_tokens: int | None = None) -> PromptSource:
    """Prepares `math_jsonl` (config from `math_jsonl_config`) and returns one split's prompts."""
    builder = prepare(MathJsonl, data_dir, config)
    return PromptSource(_split(builder, split), tokenizer, template=template, levels=levels,
                        max_prompt_tokens=max_prompt_tokens)


def _split(builder, split: str) -> Sequence[dict]:
    sources = builder.as_data_source()
    if split not in sources:
        raise ValueError(f"{builder.name}: no split {split!r}; have {sorted(sources)}")
    return sources[split]
