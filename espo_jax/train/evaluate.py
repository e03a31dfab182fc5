"""Held-out evaluation: greedy accuracy (overall and per level) and pass@k."""

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
    verify: Callable[[str, str], bool],
    pass_k: int = 0,
    rng: jax.Array | None = None,
) -> dict[str, float]:
    """Greedy accuracy of the engine's loaded weights on `prompts` (each with `tokens`,
    `answer`, `level`), per level as `eval/accuracy_level{n}`, and pass@k (k samples at
    temperature 1: solved if any is right) when `pass_k` > 0."""
    requests = [Request(prompt_id=str(p["prompt_id"]), tokens=list(p["tokens"])) for p in prompts]
    greedy = dataclasses.replace(engine.sampling, temperature=0.0, top_k=0, top_p=1.0)
    groups = engine.generate_groups(requests, n_samples=1, sampling=greedy, rng=rng)
    correct = np.array([verify(decode(g.responses[0].tokens), p["answer"])
                        for g, p in zip(groups, prompts, strict=True)])
    metrics = {"eval/accuracy": float(correct.mean()) if len(correct) else 0.0}
    by_level = defaultdict(list)
    for ok, p in zip(correct, prompts, strict=True):
        by_level[int(p.get("level", 0))].append(ok)
    for level, oks in sorted(by_level.items()):
        metrics[f"eval/accuracy_level{level}"] = float(np.mean(oks))
    metrics["eval/mean_response_len"] = float(np.mean([len(g.responses[0].tokens) for g in groups]))
    if pass_k > 0:
        sampled = dataclasses.replace(engine.sampling, temperature=1.0, top_k=0, top_p=1.0)
        groups = engine.generate_groups(requests, n_samples=pass_k, sampling=sampled,
                                        rng=rng)
        solved = [any(verify(decode(r.tokens), p["answer"]) for r in g.responses)
                  for g, p in zip(groups, prompts, strict=True)]
        metrics["eval/pass_at_k"] = float(np.mean(solved)) if solved else 0.0
    return metrics
