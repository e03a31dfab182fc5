"""Per-response advantages of rollout groups, on the host: each group's advantages of its
rewards (`rl.advantages.ADVANTAGES`, per group, so groups may have different sizes), its RL-ZVP
sign (`rl.advantages.zvp_signs`), and which responses enter the loss.

A response whose reward call failed or timed out (`zve.groups.reward_failed`) has no outcome,
which is not a wrong one: it is left out of its group's statistics and sign and out of the loss
(`trained_responses`: its loss mask is 0). The learner (`train.learner`) packs what these give.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from espo_jax.buffer.records import RolloutGroup
from espo_jax.rl.advantages import ADVANTAGES, overlong_penalty, zvp_signs
from espo_jax.zve.groups import reward_failed


def group_advantages(
    groups: Sequence[RolloutGroup], rewards: Sequence[np.ndarray], name: str, use_zvp: bool,
    zvp_wrong: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Per response (groups concatenated): advantages of `rewards` (one float32 array per
    group, in the groups' order) and the RL-ZVP sign (`rl.advantages.zvp_signs`: +1 all-correct,
    -1 all-wrong zero-variance group, 0 otherwise; 0 everywhere without `use_zvp`). Outcomes
    are the responses' binary `outcome`; the responses' `reward` fields are not read.

    A response whose reward call failed or timed out (`zve.groups.reward_failed`) has no
    outcome: its group's advantages and sign are those of its scored responses alone
    (rewards [1, 1, failed] are GRPO's [1, 1], an all-correct zero-variance group), and it
    gets advantage 0 and sign 0 (`trained_responses` masks it out of the loss). A group with
    no scored response gets 0 and 0 throughout."""
    if len(rewards) != len(groups):
        raise ValueError(f"group_advantages: {len(rewards)} reward arrays for {len(groups)} "
                         f"groups")
    advs, signs = [], []
    for g, group_rewards in zip(groups, rewards, strict=True):
        rewards_g = np.asarray(group_rewards, np.float32)
        if rewards_g.shape != (g.num_responses,):
            raise ValueError(f"group_advantages: group {g.prompt_id!r} has {g.num_responses} "
                             f"responses but rewards of shape {rewards_g.shape}")
        scored = ~reward_failed(g)
        rewards_k = rewards_g[scored]
        outcomes = np.array([bool(r.outcome) for r in g.responses])[scored]
        adv, sign = np.zeros(len(rewards_g)), np.zeros(len(rewards_g), np.float32)
        if len(rewards_k) > 1:
            adv[scored] = np.asarray(ADVANTAGES[name](rewards_k[None]))[0]
        # Without `zvp_wrong` an all-wrong group keeps its (zero) group advantage.
        if use_zvp and len(rewards_k):
            sign[scored] = float(zvp_signs(rewards_k[None], outcomes[None], zvp_wrong)[0])
        advs.append(adv)
        signs.append(sign)
    if not advs:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate(advs).astype(np.float32), np.concatenate(signs)


def config_advantages(groups: Sequence[RolloutGroup], rewards: Sequence[np.ndarray], config
                      ) -> tuple[np.ndarray, np.ndarray]:
    """`group_advantages` as a run's config sets it (`advantage.name`, `zve.zvp`); with
    `advantage.overlong_buffer` > 0 DAPO's overlong penalty is added to the rewards first. Per
    group, so a subset of groups gets the advantages it gets in the whole batch."""
    buffer = config.advantage.overlong_buffer
    if buffer > 0:
        max_len = config.rollout.max_new_tokens
        rewards = [np.asarray(rw, np.float32) + np.asarray(overlong_penalty(
            np.array([r.length for r in g.responses]), max_len, buffer))
            for g, rw in zip(groups, rewards, strict=True)]
    return group_advantages(groups, rewards, config.advantage.name, config.zve.zvp.enabled,
                            config.zve.zvp.wrong_groups)


def trained_responses(groups: Sequence[RolloutGroup]) -> np.ndarray:
    """bool per response (groups concatenated): False where the response's reward call failed
    or timed out (`zve.groups.reward_failed`). Such a response is packed like any other (the
    batch shapes and the minibatches' members do not depend on it) but its loss mask is 0:
    no policy-gradient term, and no token in the loss's denominators."""
    if not groups:
        return np.zeros(0, bool)
    return ~np.concatenate([reward_failed(g) for g in groups])
