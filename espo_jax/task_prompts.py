"""A task's prompts ready for the engine: tokenised, length-checked, ids checked.

`prompt_sources` loads the run's task (`espo_jax.task_loading`), tries its reward once
(`check_reward`) and gives its splits as `TokenizedPrompts` (chat messages through the
tokenizer's chat template, text with a bos).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence

from espo_jax.cli_errors import UserError
from espo_jax.rewards.pool import normalize_reward
from espo_jax.task_loading import load_task
from espo_jax.tasks import Task, reward_target

PROBE_COMPLETION = "0"  # the dummy completion a task's reward is tried on before any work


class TokenizedPrompts(Sequence):
    """A task's prompt dicts with `tokens` (and `prompt` as the text the model sees), built on
    access: chat messages go through `tokenizer.apply_chat_template` (no extra bos: the
    template has its own), text gets `encode(text, add_bos=True)`. Prompts that already carry
    `tokens` (the built-in TFDS sources) pass through."""

    def __init__(self, prompts: Sequence[Mapping], tokenizer, *, split: str, task: str,
                 max_prompt_tokens: int | None = None):
        self._prompts, self._tokenizer = prompts, tokenizer
        self._split, self._task, self._max = split, task, max_prompt_tokens

    @property
    def prompts(self) -> Sequence[Mapping]:
        """The task's prompt dicts, untokenised."""
        return self._prompts

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
        if self._max is not None and len(tokens) > self._max:
            raise UserError(f"task {self._task!r}: prompt {out['prompt_id']!r} has "
                            f"{len(tokens)} tokens > rollout.max_prompt_len={self._max}; set "
                            f"--config.rollout.max_prompt_len={len(tokens)} (or more), or 0 to "
                            "size it from the task's prompts")
        out.update(prompt=prompt, tokens=tokens, level=int(out["level"]),
                   prompt_id=str(out["prompt_id"]))
        return out


def prompt_sources(config, workdir: str, tokenizer) -> tuple[Task, dict[str, Sequence[dict]]]:
    """(task, {"train", "warm", "validation", "test": tokenised prompts}); a split the task
    lacks is empty. The reward is tried on the first train and held-out (`eval.split`) prompt
    before the rest are tokenised (`check_reward`); then every prompt is measured and
    `rollout.max_prompt_len` sized or checked (`size_prompt_len`)."""
    task = load_task(config, workdir, tokenizer)
    splits = {split: TokenizedPrompts(prompts, tokenizer, split=split, task=task.name)
              for split, prompts in (("train", task.train), ("warm", task.warm or task.train),
                                     ("validation", task.validation), ("test", task.test))}
    check_reward(task, [(split, splits[split][0]) for split in ("train", config.eval.split)
                        if len(splits[split])], config.rollout.reward_backend)
    out = {}
    for split, tokenized in splits.items():
        if isinstance(tokenized.prompts, list):  # a task's own list: tokenise now
            tokenized = [tokenized[i] for i in range(len(tokenized))]
        out[split] = tokenized
    _check_ids(task, out)
    measured = ("train", "warm", "validation", "test") if task.warm else (
        "train", "validation", "test")  # warm is train's prompts when the task has no warm set
    limit = size_prompt_len(config, task.name, {split: out[split] for split in measured})
    for tokenized in splits.values():  # prompts tokenised later (on access) are checked then
        tokenized._max = limit
    return task, out


PROMPT_LEN_MULTIPLE = 4  # a derived rollout.max_prompt_len is rounded up to a multiple of this


def size_prompt_len(config, task_name: str, splits: Mapping[str, Sequence[dict]]) -> int:
    """Sizes `config.rollout.max_prompt_len` from the task's longest prompt (in tokens, after
    the chat template) when it is 0, rounded up to a multiple of `PROMPT_LEN_MULTIPLE` (a
    prompt a few tokens longer does not change the compiled shapes), and logs it once; an
    explicit limit that a prompt exceeds is an error naming the longest prompt, its id and the
    key to set. Either way every prompt of every split is measured, and a packed row
    (`train.pack_len` > 0) must hold a whole RL row. Returns the limit."""
    import logging

    longest, where, lengths = 0, "", []
    for split, prompts in splits.items():
        for i in range(len(prompts)):
            p = prompts[i]
            lengths.append(len(p["tokens"]))
            if lengths[-1] > longest:
                longest, where = lengths[-1], f"{split} prompt {str(p['prompt_id'])!r}"
    r = config.rollout
    if r.max_prompt_len == 0:
        r.max_prompt_len = -(-max(longest, 1) // PROMPT_LEN_MULTIPLE) * PROMPT_LEN_MULTIPLE
        logging.info("rollout.max_prompt_len=%d from the longest prompt of task %r: %s, %d "
                     "tokens (rounded up to a multiple of %d)", r.max_prompt_len, task_name,
                     where, longest, PROMPT_LEN_MULTIPLE)
    elif longest > r.max_prompt_len:
        over = sum(n > r.max_prompt_len for n in lengths)
        raise UserError(
            f"task {task_name!r}: its longest prompt, {where}, has {longest} tokens > "
            f"rollout.max_prompt_len={r.max_prompt_len} ({over} of {len(lengths)} prompts are "
            f"longer); set --config.rollout.max_prompt_len={longest} (or more), or 0 to size it "
            "from the task's prompts")
    row = r.max_prompt_len + r.max_new_tokens - 1
    if config.train.pack and 0 < config.train.pack_len < row:
        raise ValueError(f"train.pack_len = {config.train.pack_len} is shorter than an RL row "
                         f"(rollout.max_prompt_len + max_new_tokens - 1 = {row}); 0 = {2 * row}")
    return r.max_prompt_len


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



def check_reward(task: Task, probes: Sequence[tuple[str, Mapping]], backend: str) -> None:
    """The task's reward, tried before any data preparation or compilation instead of at the
    first rollout or evaluation: with the process reward pool (`backend` "process") it must
    pickle, and it is called once in this process on each `(split, tokenised prompt)` of
    `probes` with the completion `PROBE_COMPLETION`. A reward that cannot be pickled, raises or
    returns no reward is a `UserError` naming the task and what to do, or the prompt id, raised
    from the reward's own exception."""
    if backend == "process":
        try:
            pickle.dumps(task.reward)
        except Exception as e:
            raise UserError(
                f"task {task.name!r}: its reward {task.reward!r} cannot be pickled "
                f"({type(e).__name__}: {e}), so the process reward pool "
                "(config.rollout.reward_backend='process') cannot send it to its workers. "
                "Define it at module level in an importable module, or set "
                "--config.rollout.reward_backend=thread (rewards scored in threads of this "
                "process; a call that times out is abandoned, not killed)") from None
    for split, prompt in probes:
        try:
            normalize_reward(task.reward(reward_target(prompt), PROBE_COMPLETION))
        except Exception as e:
            raise UserError(
                f"task {task.name!r}: the reward failed on {split} prompt "
                f"{prompt['prompt_id']!r} ({type(e).__name__}: {e}), tried once on the "
                f"completion {PROBE_COMPLETION!r} before any work; fix the reward or the "
                "prompts it reads (its traceback follows)") from e
