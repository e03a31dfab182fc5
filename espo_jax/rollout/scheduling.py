"""Length-aware scheduling of rollout requests (the paper's "length-based load balancing").

A decode slot is busy for as many steps as its response is long. With continuous batching the
time lost to idle slots is concentrated at the end of a batch: if the longest requests are
admitted last, most slots have nothing to do while they finish. Admitting the longest-predicted
requests first (and spreading predicted work evenly across engines) shortens that tail, the way
longest-processing-time-first (LPT) list scheduling bounds a makespan to 4/3 of optimal.

Three pieces, each a small pure-ish object or function:
- `LengthPredictor`: predicted response length per prompt from its history (an exponential
  moving average of the mean length of its past groups), with a prior for unseen prompts (the
  running mean over all observed groups, or `prior_length` before anything was observed).
- `admission_order`: the order in which a driver admits requests ("fifo" or "longest_first").
- `balance_lpt`: assigns requests to `n_workers` engines so predicted work is balanced.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

ADMISSION_POLICIES = ("fifo", "longest_first")


class LengthPredictor:
    """Predicts a prompt's response length from the lengths of its past groups.

    `predict(pid)` is the EMA of the mean response length of the prompt's observed groups
    (`ema` is the weight of the newest group); an unseen prompt gets the mean over every group
    observed so far, or `prior_length` when nothing was observed. The state is a JSON-friendly
    dict (`state_dict` / `from_state_dict`) so it can be saved with a checkpoint.
    """

    def __init__(self, prior_length: float = 128.0, ema: float = 0.5):
        if prior_length <= 0:
            raise ValueError(f"LengthPredictor: prior_length must be > 0, got {prior_length}")
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"LengthPredictor: ema must be in (0, 1], got {ema}")
        self.prior_length = float(prior_length)
        self.ema = float(ema)
        self._per_prompt: dict[str, float] = {}
        self._total_length = 0.0
        self._total_groups = 0

    def observe(self, prompt_id: Hashable, lengths: Sequence[int]) -> None:
        """Records one finished group of response `lengths` for `prompt_id`."""
        if len(lengths) == 0:
            raise ValueError(f"LengthPredictor.observe: no lengths for prompt {prompt_id!r}")
        mean = sum(float(n) for n in lengths) / len(lengths)
        key = str(prompt_id)
        old = self._per_prompt.get(key)
        self._per_prompt[key] = mean if old is None else self.ema * mean + (1 - self.ema) * old
        self._total_length += mean
        self._total_groups += 1

    def predict(self, prompt_id: Hashable) -> float:
        """Predicted response length (tokens) of `prompt_id`."""
        known = self._per_prompt.get(str(prompt_id))
        if known is not None:
            return known
        return self.prior()

    def prior(self) -> float:
        """The prediction for an unseen prompt."""
        if self._total_groups:
            return self._total_length / self._total_groups
        return self.prior_length

    def __len__(self) -> int:
        return len(self._per_prompt)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prior_length": self.prior_length,
            "ema": self.ema,
            "per_prompt": dict(self._per_prompt),
            "total_length": self._total_length,
            "total_groups": self._total_groups,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> LengthPredictor:
        out = cls(prior_length=state["prior_length"], ema=state["ema"])
        out._per_prompt = {str(k): float(v) for k, v in state["per_prompt"].items()}
        out._total_length = float(state["total_length"])
        out._total_groups = int(state["total_groups"])
        return out


def admission_order(predicted_lengths: Sequence[float], policy: str = "fifo") -> list[int]:
    """Indices of requests in the order a driver should admit them.

    "fifo": request order. "longest_first": descending predicted length, ties in request order
    (a stable sort, so the order never depends on anything but the predictions).
    """
    if policy not in ADMISSION_POLICIES:
        raise ValueError(f"admission policy {policy!r} unknown; choose one of {ADMISSION_POLICIES}")
    idx = list(range(len(predicted_lengths)))
    if policy == "fifo":
        return idx
    return sorted(idx, key=lambda i: -float(predicted_lengths[i]))


def balance_lpt(work: Sequence[float], n_workers: int) -> list[list[int]]:
    """Longest-processing-time-first assignment of items with predicted `work` to workers.

    Items are taken in descending work (ties by index) and each goes to the worker with the
    least assigned work so far (ties to the lowest worker id). Returns, per worker, the item
    indices in the order they were assigned (longest first, which is also the order each worker
    should admit them). Deterministic for a given input.
    """
    if n_workers < 1:
        raise ValueError(f"balance_lpt: n_workers must be >= 1, got {n_workers}")
    if any(float(w) < 0 for w in work):
        raise ValueError("balance_lpt: work must be non-negative")
    heap = [(0.0, w) for w in range(n_workers)]
    out: list[list[int]] = [[] for _ in range(n_workers)]
    for i in sorted(range(len(work)), key=lambda i: -float(work[i])):
        load, w = heapq.heappop(heap)
        out[w].append(i)
        heapq.heappush(heap, (load + float(work[i]), w))
    return out
