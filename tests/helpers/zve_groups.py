"""For the MS-ZVE tests: prompt dicts, the ids of a drawn plan, and scored `RolloutGroup`s built
from outcomes and lengths by hand."""

import numpy as np

from espo_jax.buffer.records import Response, RolloutGroup


def make_group(outcomes, lengths=None, pid="p", credits=None, rewards=None) -> RolloutGroup:
    """One group: response j has outcome `outcomes[j]`, `lengths[j]` tokens (default 4),
    `reward_components["step_credit"] = credits[j]` when given, and `reward` `rewards[j]`
    (default the outcome: what the reward function wrote)."""
    n = len(outcomes)
    lengths = [4] * n if lengths is None else list(lengths)
    rewards = [float(o) for o in outcomes] if rewards is None else list(rewards)
    responses = [
        Response(tokens=np.full(t, 7, np.int32), logprobs=np.zeros(t, np.float32),
                 outcome=int(o), reward=float(r),
                 reward_components={} if credits is None else {"step_credit": float(c)})
        for o, t, r, c in zip(outcomes, lengths, rewards, credits or [0.0] * n, strict=True)
    ]
    return RolloutGroup(prompt_id=pid, prompt_tokens=np.array([1, 2], np.int32),
                        policy_version=0, sampler="test", created_at=0.0, responses=responses)


def reward_fields(groups) -> list[list]:
    """Every response's `reward` field, to check that nothing wrote to them."""
    return [[r.reward for r in g.responses] for g in groups]


def prompts(n: int) -> list[dict]:
    """`n` prompt dicts `p0`, `p1`, ... as a prompt source gives them."""
    return [{"prompt_id": f"p{i}", "prompt": f"{i}+1="} for i in range(n)]


def ids(drawn) -> list:
    """The prompt ids of a scheduler's plan `[(prompt, n_samples), ...]`."""
    return [p["prompt_id"] for p, _ in drawn]
