"""Train-inference mismatch of sampled groups: how far the rollout engine's numbers are from the
learner's.

`measure_mismatch` recomputes, with the learner's forward and parameters, the log-prob of every
response token the engine sampled, with or without router replay (feeding the recorded
`routed_experts` back, R3), and reports `espo_jax.mismatch.mismatch_metrics` of them: the same
computation and keys as the learner's old-policy pass logs every step.

Works on anything shaped like `records.RolloutGroup` or `engine.GenerationGroup` (attributes
`prompt_tokens` and `responses[i].tokens / .logprobs / .routed_experts`, -1 = no routing).
The comparison only means "same policy" when the engine ran at temperature 1 with no top-k /
top-p truncation (then its log-probs are the model's log-softmax).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax import mismatch, models
from espo_jax.models.config import ModelConfig


@functools.partial(jax.jit, static_argnums=(0, 4))
def _learner_logp(config: ModelConfig, params, tokens_BxT, valid_BxT, replay: bool, experts):
    out = models.forward(
        config,
        params,
        tokens_BxT,
        attention_mask_BxT=valid_BxT,
        routed_experts_BxTxMxk=experts if replay else None,
    )
    logp_BxTxV = jax.nn.log_softmax(out.logits[:, :-1].astype(jnp.float32), axis=-1)
    logp_BxT1 = jnp.take_along_axis(logp_BxTxV, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
    if out.router_logits:  # the learner's own choice, given the same upstream inputs
        natural = out.own_experts
    else:
        natural = jnp.zeros(experts.shape, jnp.int32)
    return logp_BxT1, natural


def _rows(groups: Iterable[Any]):
    for g in groups:
        prompt = np.asarray(g.prompt_tokens, np.int32)
        for r in g.responses:
            yield prompt, r


def measure_mismatch(
    config: ModelConfig,
    learner_params: dict,
    groups: Iterable[Any],
    replay: bool,
    *,
    batch_size: int = 16,
) -> dict[str, float]:
    """`espo_jax.mismatch.mismatch_metrics` (floats) over every response token of `groups`;
    the routing keys where the model has MoE layers."""
    rows = list(_rows(groups))
    if not rows:
        raise ValueError("measure_mismatch: no responses in groups")
    m, k = config.n_moe_layers, config.top_k
    if replay and m and any(r.routed_experts is None for _, r in rows):
        raise ValueError("measure_mismatch(replay=True) needs routed_experts on every response")
    longest = max(len(p) + len(r.tokens) for p, r in rows)
    t = max(16, 1 << (longest - 1).bit_length())  # bucketed: few compiled shapes
    learner, rollout, mask, own, recorded = [], [], [], [], []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        tokens = np.zeros((batch_size, t), np.int32)
        valid = np.zeros((batch_size, t), bool)
        experts = np.full((batch_size, t, m, k), -1, np.int32)
        rollout_logp = np.zeros((batch_size, t), np.float32)
        response = np.zeros((batch_size, t), np.float32)
        for b, (prompt, r) in enumerate(chunk):
            seq = np.concatenate([prompt, np.asarray(r.tokens, np.int32)])
            tokens[b, : len(seq)], valid[b, : len(seq)] = seq, True
            p, n = len(prompt), len(r.tokens)  # position p - 1 + j predicts response token j
            rollout_logp[b, p - 1 : p - 1 + n] = np.asarray(r.logprobs, np.float32)
            response[b, p - 1 : p - 1 + n] = 1.0
            if m and r.routed_experts is not None:
                re = np.asarray(r.routed_experts)
                if re.shape != (len(seq), m, k):
                    raise ValueError(
                        f"routed_experts has shape {re.shape}, expected "
                        f"{(len(seq), m, k)} (prompt + response, M, k)"
                    )
                experts[b, : len(seq)] = re
        logp, natural = jax.device_get(
            _learner_logp(
                config,
                learner_params,
                jnp.asarray(tokens),
                jnp.asarray(valid),
                replay,
                jnp.asarray(experts),
            )
        )
        learner.append(np.pad(logp, ((0, 0), (0, 1))))  # the last position predicts nothing
        rollout.append(rollout_logp)
        mask.append(response)
        own.append(natural)
        recorded.append(experts)
    routing = {}
    if m:
        routing = dict(own_BxTxMxk=np.concatenate(own), recorded_BxTxMxk=np.concatenate(recorded))
    out = mismatch.mismatch_metrics(
        np.concatenate(learner), np.concatenate(rollout), np.concatenate(mask), **routing
    )
    return {key: float(v) for key, v in jax.device_get(out).items()}
