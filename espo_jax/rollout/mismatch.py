"""Train-inference mismatch: how far the rollout engine's numbers are from the learner's.

`measure_mismatch` recomputes, with the learner's forward and parameters, the log-prob of every
response token the engine sampled, with or without router replay (feeding the recorded
`routed_experts` back, R3), and compares:
- per token |logp_learner - logp_rollout| (mean, max) and the k3 estimate of
  KL(rollout || learner) = E_rollout[r - 1 - log r], r = p_learner / p_rollout;
- the routing flip rate per MoE layer: the share of (token, layer) decisions where the learner's
  own top-k set (top-k of its live router logits, given the same upstream inputs) differs from
  the recorded one. Under replay the experts *used* are the recorded ones by construction; the
  flip rate then says how often replay overrode the learner's choice.

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

from espo_jax import models
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
    if out.router_logits:
        logits = jnp.stack(out.router_logits, axis=2)  # [B, T, M, E]
        natural = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), config.top_k)[1]
    else:
        natural = jnp.zeros(experts.shape, jnp.int32)
    return logp_BxT1, natural


def _mean_abs(x: np.ndarray) -> float:
    return float(np.mean(np.abs(x))) if x.size else 0.0


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
    """Mismatch metrics (see module doc) over every response token of `groups`.

    Keys: mismatch/logp_abs_mean, mismatch/logp_abs_max, mismatch/kl_k3, mismatch/tokens,
    mismatch/logp_abs_mean_at_flips and _elsewhere (tokens predicted at a position where any
    layer's routing flipped, and the rest), mismatch/tokens_at_flips,
    moe/routing_flip_rate (mean over layers) and moe/routing_flip_rate/layer_{m}.
    """
    rows = list(_rows(groups))
    if not rows:
        raise ValueError("measure_mismatch: no responses in groups")
    m, k = config.n_moe_layers, config.top_k
    if replay and m and any(r.routed_experts is None for _, r in rows):
        raise ValueError("measure_mismatch(replay=True) needs routed_experts on every response")
    longest = max(len(p) + len(r.tokens) for p, r in rows)
    t = max(16, 1 << (longest - 1).bit_length())  # bucketed: few compiled shapes
    deltas, flipped_tok, flips, counted = [], [], np.zeros(m), np.zeros(m)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        tokens = np.zeros((batch_size, t), np.int32)
        valid = np.zeros((batch_size, t), bool)
        experts = np.full((batch_size, t, m, k), -1, np.int32)
        for b, (prompt, r) in enumerate(chunk):
            seq = np.concatenate([prompt, np.asarray(r.tokens, np.int32)])
            tokens[b, : len(seq)], valid[b, : len(seq)] = seq, True
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
        for b, (prompt, r) in enumerate(chunk):
            p, n = len(prompt), len(r.tokens)
            deltas.append(logp[b, p - 1 : p - 1 + n] - np.asarray(r.logprobs, np.float32))
            flipped_T = np.zeros(p + n, bool)
            if m and r.routed_experts is not None:
                rec = experts[b, : p + n]
                has = np.all(rec >= 0, axis=-1)  # [T, M]
                same = np.all(np.sort(rec, -1) == np.sort(natural[b, : p + n], -1), axis=-1)
                flips += np.sum(has & ~same, axis=0)
                counted += np.sum(has, axis=0)
                flipped_T = np.any(has & ~same, axis=-1)
            flipped_tok.append(flipped_T[p - 1 : p - 1 + n])  # the position predicting it
    d = np.concatenate(deltas).astype(np.float64)  # logp_learner - logp_rollout
    at_flip = np.concatenate(flipped_tok)
    out = {
        # Tokens predicted at a position where some layer's routing flipped, and the others.
        "mismatch/logp_abs_mean_at_flips": _mean_abs(d[at_flip]),
        "mismatch/logp_abs_mean_elsewhere": _mean_abs(d[~at_flip]),
        "mismatch/tokens_at_flips": float(np.sum(at_flip)),
        "mismatch/logp_abs_mean": float(np.mean(np.abs(d))) if d.size else 0.0,
        "mismatch/logp_abs_max": float(np.max(np.abs(d))) if d.size else 0.0,
        "mismatch/kl_k3": float(np.mean(np.expm1(d) - d)) if d.size else 0.0,
        "mismatch/tokens": float(d.size),
    }
    if m:
        per_layer = flips / np.maximum(counted, 1)
        out["moe/routing_flip_rate"] = float(np.mean(per_layer))
        for i, f in enumerate(per_layer):
            out[f"moe/routing_flip_rate/layer_{i}"] = float(f)
    return out
