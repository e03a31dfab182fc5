"""Held-out evaluation: greedy accuracy, and with `pass_k` pass@k and the mean accuracy of the
k samples (pass@1 at temperature 1), overall and per level.

Per level, the gap between pass@k and greedy accuracy is the headroom RL can reach by sharpening
the policy; a level with pass@k near 0 gives RL no reward contrast to learn from."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from espo_jax.rollout.engine import Engine, Request


def evaluate(
    engine: Engine,
    prompts: Sequence[Mapping],
    *,
    decode: Callable[[Sequence[int]], str],
    outcome: Callable[[Mapping, str], bool],
    pass_k: int = 0,
    rng: jax.Array | None = None,
) -> dict[str, float]:
    """Greedy accuracy of the engine's loaded weights on `prompts` (each with `tokens` and
    `level`; `outcome(prompt, text)` decides a response), per level as
    `eval/accuracy_level{n}`; when `pass_k` > 0 also pass@k (k samples at temperature 1: solved
    if any is right) and the samples' mean accuracy (`eval/sample_accuracy`), each overall and
    per level."""
    requests = [Request(prompt_id=str(p["prompt_id"]), tokens=list(p["tokens"])) for p in prompts]
    greedy = dataclasses.replace(engine.sampling, temperature=0.0, top_k=0, top_p=1.0)
    groups = engine.generate_groups(requests, n_samples=1, sampling=greedy, rng=rng)
    correct = np.array([outcome(p, decode(g.responses[0].tokens))
                        for g, p in zip(groups, prompts, strict=True)])
    levels = [int(p.get("level", 0)) for p in prompts]
    metrics = _per_level("eval/accuracy", correct, levels)
    metrics["eval/mean_response_len"] = float(np.mean([len(g.responses[0].tokens) for g in groups]))
    if pass_k > 0:
        sampled = dataclasses.replace(engine.sampling, temperature=1.0, top_k=0, top_p=1.0)
        groups = engine.generate_groups(requests, n_samples=pass_k, sampling=sampled,
                                        rng=rng)
        right = np.array([[outcome(p, decode(r.tokens)) for r in g.responses]
                          for g, p in zip(groups, prompts, strict=True)], bool).reshape(-1, pass_k)
        metrics.update(_per_level("eval/pass_at_k", right.any(axis=1), levels))
        metrics.update(_per_level("eval/sample_accuracy", right.mean(axis=1), levels))
    return metrics


def _per_level(name: str, values: np.ndarray, levels: Sequence[int]) -> dict[str, float]:
    """`name` (the mean of `values`) and `{name}_level{n}` (the mean per level)."""
    values = np.asarray(values, np.float64)
    out = {name: float(values.mean()) if len(values) else 0.0}
    by_level = defaultdict(list)
    for v, level in zip(values, levels, strict=True):
        by_level[level].append(v)
    for level, vs in sorted(by_level.items()):
        out[f"{name}_level{level}"] = float(np.mean(vs))
    return out
