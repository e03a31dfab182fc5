"""A task's prompts ready for the engine: tokenised, length-checked, ids checked.

`prompt_sources` loads the run's task (`espo_jax.task_loading`) and gives its splits as
`TokenizedPrompts` (chat messages through the tokenizer's chat template, text with a bos).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from espo_jax.task_loading import load_task
from espo_jax.tasks import Task


class TokenizedPrompts(Sequence):
    """A task's prompt dicts with `tokens` (and `prompt` as the text the model sees), built on
    access: chat messages go through `tokenizer.apply_chat_template` (no extra bos: the
    template has its own), text gets `encode(text, add_bos=True)`. Prompts that already carry
    `tokens` (the built-in TFDS sources) pass through."""

    def __init__(self, prompts: Sequence[Mapping], tokenizer, *, split: str, task: str,
                 max_prompt_tokens: int):
        self._prompts, self._tokenizer = prompts, tokenizer
        self._split, self._task, self._max = split, task, max_prompt_tokens

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        p = self._prompts[i]
        if "tokens" in p:
            return dict(p)
        out = {"prompt_id": f"{self._split}/{i}", "level": 0, "solution": "", **p}
        prompt = out["prompt"]
        if isinstance(prompt, str):
            tokens = self._tokenizer.encode(prompt, add_bos=True)
        elif isinstance(prompt, Sequence):
            prompt = self._tokenizer.apply_chat_template(list(prompt))
            tokens = self._tokenizer.encode(prompt)
        else:
            raise TypeError(f"task {self._task!r}: prompt {out['prompt_id']!r} is a "
                            f"{type(prompt).__name__}; give text or chat messages")
        if len(tokens) > self._max:
            raise ValueError(f"task {self._task!r}: prompt {out['prompt_id']!r} has "
                             f"{len(tokens)} tokens > rollout.max_prompt_len={self._max}")
        out.update(prompt=prompt, tokens=tokens, level=int(out["level"]),
                   prompt_id=str(out["prompt_id"]))
        return out


def prompt_sources(config, workdir: str, tokenizer) -> tuple[Task, dict[str, Sequence[dict]]]:
    """(task, {"train", "warm", "validation", "test": tokenised prompts}); a split the task
    lacks is empty. Every prompt's length is checked here for tasks given as lists."""
    task = load_task(config, workdir, tokenizer)
    limit = config.rollout.max_prompt_len
    out = {}
    for split, prompts in (("train", task.train), ("warm", task.warm or task.train),
                           ("validation", task.validation), ("test", task.test)):
        tokenized = TokenizedPrompts(prompts, tokenizer, split=split, task=task.name,
                                     max_prompt_tokens=limit)
        if isinstance(prompts, list):  # a task's own list: tokenise (and check) every prompt now
            tokenized = [tokenized[i] for i in range(len(tokenized))]
        out[split] = tokenized
    _check_ids(task, out)
    return task, out


def _check_ids(task: Task, splits: dict[str, Sequence[dict]]) -> None:
    """Prompt ids are the scheduler's keys: two prompts of the train split with one id, or a
    train id reused in validation or test, is an error naming it (built-in sources are
    checked by their builders)."""
    train = splits["train"]
    if not isinstance(train, list):
        return
    ids = [p["prompt_id"] for p in train]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"task {task.name!r}: prompt_id {dup!r} appears twice in train")
    for split in ("validation", "test"):
        if isinstance(splits[split], list):
            shared = set(ids) & {p["prompt_id"] for p in splits[split]}
            if shared:
                raise ValueError(f"task {task.name!r}: prompt ids {sorted(shared)[:3]} are in "
                                 f"both train and {split}")

