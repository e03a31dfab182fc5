"""Generation + overlapped scoring -> scored `RolloutGroup`s: the rollout side of one step.

Shared by the single-process loop and the rollout worker. The engine calls back as each group
finishes; its responses go to the reward pool at once, so scoring overlaps the decoding of the
groups still running. Groups come back in plan order (the engine's order), whatever the timing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.rewards.pool import RewardPool
from espo_jax.rollout.engine import Engine, GenerationGroup, Request


def generate_scored_groups(
    engine: Engine,
    pool: RewardPool,
    plan: Sequence[tuple[Mapping, int]],
    *,
    rng: jax.Array,
    policy_version: int,
    n_experts: int | None,
    admission: str = "fifo",
    predictor=None,
    target_fn: Callable[[Mapping], Any],
    meta: Mapping | None = None,
    task: str = "",
) -> list[RolloutGroup]:
    """Samples `n` responses for each `(prompt, n)` of `plan`, scores them, returns records.

    `prompt` is a prompt dict (`prompt_id`, `tokens`, `answer`, ...). Request i draws from
    `rng` with seed i, so the result depends only on the weights, `rng` and the plan. The
    reward function gets `target_fn(prompt)` as its reference: `tasks.reward_fn(task)` returns the
    pair (a task's reward reads the whole prompt, `tasks.reward_target`; a plain `(text, answer)`
    reward takes `lambda p: p["answer"]`). It has no default: a wrong reference scores every
    response wrong without any error.
    `engine` is any `espo_jax.rollout.sampler.Sampler` (an `Engine` is one); `meta` goes into
    every group's meta (the worker puts its writer id there). A response whose reward failed
    is logged with `task`, the prompt id and the pool's error (with the reward's traceback),
    once per group, and listed in the group's meta (`reward_failed`: the responses' indices; MS-ZVE
    reads their outcomes as missing, not wrong, `espo_jax.zve.groups.reward_failed`; those that
    timed out also in `reward_timed_out`).
    """
    requests = [
        Request(prompt_id=str(p["prompt_id"]), tokens=list(p["tokens"]), n_samples=n)
        for p, n in plan
    ]
    tag = f"{policy_version}:{time.monotonic_ns()}"

    def score(group: GenerationGroup) -> None:
        prompt = plan[group.request_index][0]
        answer = target_fn(prompt)
        for j, gen in enumerate(group.responses):
            pool.submit((tag, group.request_index), j, gen.tokens.tolist(), answer)

    generated = engine.generate_groups(
        requests, rng=rng, admission=admission, predictor=predictor, on_group=score
    )
    out = []
    for group in generated:
        prompt = plan[group.request_index][0]
        results = pool.wait_group((tag, group.request_index), len(group.responses))
        responses = [
            Response(
                tokens=gen.tokens,
                logprobs=gen.logprobs,
                routed_experts=gen.routed_experts,
                finish_reason=gen.finish_reason,
                outcome=bool(res.outcome),
                reward=float(res.reward),
                reward_components=dict(res.components),
            )
            for gen, res in zip(group.responses, results, strict=True)
        ]
        failed = [res for res in results if res.failed]
        group_meta = {"answer": str(prompt.get("answer", "")),
                      "level": int(prompt.get("level", 0)), **(meta or {})}
        if failed:
            group_meta["reward_failed"] = [res.response_idx for res in failed]
            timed_out = [res.response_idx for res in failed if res.timed_out]
            if timed_out:  # of those, the ones past the timeout (the rest raised or crashed)
                group_meta["reward_timed_out"] = timed_out
            logging.warning("task %r: reward failed on %d of %d responses of prompt %r; first "
                            "(response %d): %s", task, len(failed), len(results),
                            group.prompt_id, failed[0].response_idx, failed[0].error)
        out.append(
            RolloutGroup(
                prompt_id=str(group.prompt_id),
                prompt_tokens=group.prompt_tokens,
                policy_version=int(policy_version),
                sampler=engine.sampler_name,
                created_at=time.time(),
                rewarded_at=time.time(),
                meta=group_meta,
                responses=responses,
                n_experts=n_experts,
            )
        )
    return out
