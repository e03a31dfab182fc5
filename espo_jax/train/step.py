"""The learner's pure functions: old-policy pass, RL update step, supervised warm-start step.

Each is a module-level pure function of `(state, batch)`; configs are bound with
`functools.partial` and the result is jitted once with explicit shardings
(`train.learner.Learner`).
Micro-batches and an update's parts are joined into its gradient by `train.accumulation`.

Router replay (`replay`):
  "r3"  replay the routing recorded by the rollout engine in both the old-policy pass and the
        policy forward (arXiv 2510.11370);
  "r2"  replay the learner's own old-policy routing in the policy forward (GSPO paper);
  "off" every forward routes with its own live top-k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections

from espo_jax import mismatch, models
from espo_jax.models import router
from espo_jax.rl import logprobs as rl_logprobs
from espo_jax.rl import losses
from espo_jax.rl.advantages import zvp_token_advantages
from espo_jax.train.accumulation import accumulate_gradients, join_parts
from espo_jax.train.batch import RLBatch
from espo_jax.train.state import TrainState, apply_gradients


def compiler_options(model_config=None) -> dict[str, str] | None:
    """XLA options of the learner's programs (`jax.jit(..., compiler_options=...)`): on CPU,
    dots by Eigen rather than YNNPACK, except for a dense (no MoE) model computing in bf16.
    YNNPACK runs a batched dot on one thread, and the MoE experts' [blocks, rows, D] x
    [blocks, D, F] products are most of a gradient's work: [72, 128, 128] x [72, 128, 256]
    takes 4.2 ms with it, 2.4 ms without; bench peers' train step 394 -> 353 ms, the default
    experiment's ESPO update 1290 -> 1193 ms (2-core Intel Xeon, 2026-12-04). A dense bf16
    model's products are 2-D, and YNNPACK's bf16 kernels (AVX512-BF16, AMX) run them at twice
    Eigen's rate, which converts them to fp32 (2048 x 576 x 1536 into fp32: 409 against 213
    GFLOP/s; a SwiGLU MLP's gradient 271 against 320 ms; 2-core AMD EPYC Zen 4, 2026-12-05).
    The rollout engine keeps YNNPACK: its decode steps are small 2-D products, which YNNPACK
    does faster. Results are reproducible run to run either way, not bitwise equal between
    the two."""
    if jax.default_backend() != "cpu":
        return None
    if (model_config is not None and not model_config.n_moe_layers
            and jnp.dtype(model_config.dtype) == jnp.bfloat16):
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": ""}


def sequence_logprobs(model_config, params, tokens, positions, targets, routed, chunk_size,
                      segments=None, unpack=None, token_weights=None, head=None, shards=1):
    """Per-token log-probs and entropies of `targets`, chunked over the vocabulary projection.

    `segments`: the rows' segment ids (`RLBatch.segment_ids`); `unpack`: packed rows' index map
    (`RLBatch.unpack`), which brings the log-probs and entropies back to one row per sequence
    (zero where a sequence has no token); `token_weights`: the tokens' aux-loss weights
    (`RLBatch.token_weights`); `head`: (`RLBatch.head_index`, `RLBatch.head_unpack`), the
    projection only at the sequences' response targets (zero elsewhere; None: everywhere);
    `shards`: `RLBatch.shards`. `out` stays on the model's rows."""
    out = models.forward(
        model_config,
        params,
        tokens,
        positions_BxT=positions,
        segment_ids_BxT=segments,
        routed_experts_BxTxMxk=routed,
        token_weights_BxT=token_weights,
        return_hidden=True,
        return_logits=False,
    )
    w_DxV = models.lm_head_kernel(model_config, params)
    hidden = out.hidden
    if head is not None:
        index_BxK, head_unpack_BxT = head
        hidden, targets = (head_rows(x, index_BxK, unpack is not None, shards)
                           for x in (out.hidden, targets))
    logp, ent = rl_logprobs.logprobs_from_hidden(hidden, w_DxV, targets, chunk_size=chunk_size)
    if head is not None:
        logp, ent = (_row_take(jnp.pad(x, ((0, 0), (0, 1))), head_unpack_BxT)
                     for x in (logp, ent))
    elif unpack is not None:
        logp, ent = unpack_rows(logp, unpack, shards), unpack_rows(ent, unpack, shards)
    return logp, ent, out


def _row_take(x_BxN, index_BxK):
    """x[b, index[b, k]] (over x's trailing axes, if any)."""
    index = index_BxK.reshape(index_BxK.shape + (1,) * (x_BxN.ndim - 2))
    return jnp.take_along_axis(x_BxN, index, axis=1)


def head_rows(x_RxWx, index_BxK, packed: bool, shards: int = 1):
    """`x` of the model's rows at the head's positions (`RLBatch.head_index`): [B, K, ...].
    Packed: flat indices as `unpack_rows`'; else row b's columns (rows = sequences)."""
    return unpack_rows(x_RxWx, index_BxK, shards) if packed else _row_take(x_RxWx, index_BxK)


def unpack_rows(x_RxT: jax.Array, unpack_BxT: jax.Array, shards: int = 1) -> jax.Array:
    """`x` of packed rows at the flat positions `unpack`, over x's trailing axes if any. With
    `shards` > 1, each of that many equal blocks of the sequences indexes its own block of the
    rows (`RLBatch.shards`): a gather per shard, local to its device. The index one past a
    block's positions (R*T / shards) reads a zero."""
    r, t = x_RxT.shape[:2]
    flat = x_RxT.reshape(shards, r // shards * t, *x_RxT.shape[2:])
    flat = jnp.concatenate([flat, jnp.zeros((shards, 1, *flat.shape[2:]), flat.dtype)], axis=1)
    if shards == 1:
        return flat[0][unpack_BxT]
    index = unpack_BxT.reshape(shards, -1, *unpack_BxT.shape[1:])
    return jax.vmap(lambda rows, i: rows[i])(flat, index).reshape(unpack_BxT.shape
                                                                   + flat.shape[2:])


def _head(batch: RLBatch):
    return None if batch.head_index is None else (batch.head_index, batch.head_unpack)


def _masked_mean(x, mask):
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _frozen_routing(batch: RLBatch, replay: str):
    """The routing a policy at the rollout's parameters replays: the recorded one under R3,
    none (its own top-k) otherwise."""
    return batch.routed_experts if replay == "r3" else None


def _frozen_pass(params, batch: RLBatch, model_config, replay: str, chunk_size: int):
    """`sequence_logprobs` of a policy that is not being trained (the old policy, the KL
    reference), routed by `_frozen_routing`."""
    return sequence_logprobs(
        model_config, params, batch.tokens, batch.positions, batch.targets,
        _frozen_routing(batch, replay), chunk_size, batch.segment_ids, batch.unpack,
        batch.token_weights, _head(batch), batch.shards,
    )


def old_policy_metrics(logp, ent, out, batch: RLBatch):
    """The old policy's train-inference mismatch (`espo_jax.mismatch.mismatch_metrics` of its
    `logp`, no gradient, against the engine's behaviour log-probs; the flip rate of its live
    routing against the recorded one) and its mean entropy. Returns (metrics, own_routing):
    the experts the learner's own live router chooses (None without MoE layers).

    Where the batch says which sequences an older policy sampled (`RLBatch.stale`, the worker
    layout), `mismatch/*` and `moe/routing_flip_rate*` are over the on-policy ones only (the
    engine's numerics, as the single process measures them) and `mismatch_stale/*`,
    `moe_stale/*` over the stale ones (numerics and the policy's change since)."""
    own = None
    if out.own_experts is not None and out.router_logits:
        own = out.own_experts
    on_mask, stale_mask = batch.loss_mask, None
    if batch.stale is not None:
        on_mask = batch.loss_mask * (1.0 - batch.stale[:, None])
        stale_mask = batch.loss_mask * batch.stale[:, None]
    routing, flipped = {}, None
    if own is not None and batch.routed_experts is not None:
        # Routing lives on the model's rows; `logp` on one row per sequence when packed.
        w = batch.token_weights
        if batch.stale_tokens is None:
            routing, flipped = mismatch.routing_metrics(own, batch.routed_experts, w)
        else:
            routing, flipped = mismatch.routing_metrics(own, batch.routed_experts,
                                                        w * (1.0 - batch.stale_tokens))
            stale, flipped_stale = mismatch.routing_metrics(own, batch.routed_experts,
                                                            w * batch.stale_tokens)
            routing |= {"moe_stale/" + k.removeprefix("moe/"): v for k, v in stale.items()}
            flipped = flipped + flipped_stale  # disjoint tokens
        if batch.unpack is not None:
            flipped = unpack_rows(flipped, batch.unpack, batch.shards)
    metrics = {**mismatch.logp_metrics(logp, batch.behaviour_logp, on_mask, flipped),
               **routing}
    if stale_mask is not None:
        metrics |= {"mismatch_stale/" + k.removeprefix("mismatch/"): v for k, v in
                    mismatch.logp_metrics(logp, batch.behaviour_logp, stale_mask,
                                          flipped).items()}
    metrics["entropy/mean"] = _masked_mean(ent, batch.loss_mask)
    return metrics, own


def old_policy_pass(params, batch: RLBatch, *, model_config, replay: str, chunk_size: int):
    """Old-policy log-probs/entropies (no gradient) and train-inference mismatch metrics."""
    logp, ent, out = _frozen_pass(params, batch, model_config, replay, chunk_size)
    logp, ent = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(ent)
    metrics, own_routing = old_policy_metrics(logp, ent, out, batch)
    return batch.replace(old_logp=logp, old_entropy=ent, old_routed_experts=own_routing), metrics


def reference_pass(ref_params, batch: RLBatch, *, model_config, replay: str, chunk_size: int):
    """`batch` with the reference policy's log-probs of its targets (for `loss.kl_coef`),
    routed like the old-policy pass."""
    logp, _, _ = _frozen_pass(ref_params, batch, model_config, replay, chunk_size)
    return batch.replace(ref_logp=jax.lax.stop_gradient(logp))


def token_advantages(batch: RLBatch, zvp_alpha: float, negative_scale: float = 1.0) -> jax.Array:
    """Sequence advantages broadcast to tokens; RL-ZVP (arXiv 2509.21880 Eq. 5, the formula of
    `rl.advantages.zvp_token_advantages`) for rows of zero-variance groups (`zv_sign` != 0).
    Negative token advantages are then multiplied by `negative_scale` (1: unchanged, 0: only
    rewarded tokens are reinforced)."""
    adv = jnp.broadcast_to(batch.advantages[:, None], batch.loss_mask.shape)
    if zvp_alpha > 0:
        adv = zvp_token_advantages(adv, batch.zv_sign, batch.old_entropy, batch.loss_mask,
                                   zvp_alpha)
    if negative_scale != 1.0:
        adv = jnp.where(adv < 0, negative_scale * adv, adv)
    return adv


def rl_loss(params, batch: RLBatch, *, model_config, loss_config, replay, chunk_size, zvp_alpha,
            negative_scale=1.0, fused=False):
    """The configured policy loss of `batch` (plus the MoE aux loss) and its metrics.

    `fused=True` is the first update of a rollout batch, at the parameters that are the old
    policy: the old log-probs and entropies are this forward's own (without gradient), so the
    old-policy pass is not run separately, and the mismatch metrics come from this forward. R2
    then routes live (its old routing is the live one); R3 replays the recordings as always."""
    if fused:  # the old policy's own forward, as in the old-policy pass
        routed = _frozen_routing(batch, replay)
    else:
        routed = {
            "r3": batch.routed_experts,
            "r2": batch.old_routed_experts,
            "off": None,
        }[replay]
    logp, ent, out = sequence_logprobs(
        model_config, params, batch.tokens, batch.positions, batch.targets, routed, chunk_size,
        batch.segment_ids, batch.unpack, batch.token_weights, _head(batch), batch.shards,
    )
    fused_metrics = {}
    if fused:
        old_logp, old_ent = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(ent)
        fused_metrics, _ = old_policy_metrics(old_logp, old_ent, out, batch)
        batch = batch.replace(old_logp=old_logp, old_entropy=old_ent)
    adv = token_advantages(batch, zvp_alpha, negative_scale)
    tis = loss_config.tis != "off"
    kl = loss_config.kl_coef > 0
    loss, metrics = losses.policy_loss(
        logp,
        batch.old_logp,
        adv,
        batch.loss_mask,
        loss_config,
        entropy=batch.old_entropy,
        behaviour_logp=batch.behaviour_logp if tis else None,
        ref_logp=batch.ref_logp if kl else None,
    )
    metrics = {**dict(metrics), **fused_metrics}
    metrics["pg/loss"] = loss
    metrics["moe/aux_loss"] = out.aux_loss
    return loss + out.aux_loss, metrics


def _finish_update(state: TrainState, loss, grads, metrics, anchor=None, *,
                   anchor_coef: float = 0.0):
    """One optimiser update on the RL gradient, plus `anchor_coef` times the supervised
    anchor's where `anchor` = its (loss, grads, metrics) is given, and the update's metrics."""
    metrics = dict(metrics)
    if anchor is not None:
        anchor_loss, anchor_grads, anchor_metrics = anchor
        grads = jax.tree.map(lambda g, a: g + anchor_coef * a, grads, anchor_grads)
        loss = loss + anchor_coef * anchor_loss
        metrics["anchor/nll"] = anchor_metrics["sft/nll"]
    state, skipped = apply_gradients(state, grads, loss)
    metrics["train/loss"] = loss
    metrics["train/grad_norm"] = _global_norm(grads)
    metrics["train/skipped_update"] = skipped
    return state, metrics


def router_bias_update(state: TrainState, parts, *, model_config) -> TrainState:
    """`state` with the MoE correction biases moved by DeepSeek's auxiliary-loss-free rule
    (`models.router.update_router_biases`, `ModelConfig.router_bias_update_rate`) from the
    expert loads of an update's rows (`parts`: its RLBatches), as their rollouts routed them
    (`RLBatch.routed_experts`; the experts the update's forward used under R3)."""
    if any(b.routed_experts is None for b in parts):
        raise ValueError("router_bias_update_rate > 0 needs the rollouts' recorded routing "
                         "(RLBatch.routed_experts)")
    routed = jnp.concatenate([b.routed_experts for b in parts])
    weights = jnp.concatenate([(b.segment_ids > 0).astype(jnp.float32) for b in parts])
    return state.replace(params=router.update_router_biases(model_config, state.params, routed,
                                                            weights))


def _anchor_needed(anchor_coef: float, anchor_batch) -> bool:
    if anchor_coef > 0 and anchor_batch is None:
        raise ValueError("anchor_coef > 0 needs an anchor_batch of worked solutions")
    return anchor_coef > 0


def rl_train_step(state: TrainState, batch: RLBatch, anchor_batch=None, *,
                  anchor_coef: float = 0.0, **loss_kw):
    """One optimiser update on a minibatch that already carries old-policy log-probs, or, with
    `fused`, the first update of a rollout batch computing them itself (see `rl_loss`):
    `rl_part_gradients(state.params, batch, **loss_kw)` of the whole minibatch, then the update.

    With `anchor_coef` > 0 the update also descends `anchor_coef` times the cross-entropy of
    `anchor_batch` (worked solutions, `sft_loss`): the RL gradient plus a supervised anchor that
    keeps what the warm start taught (InstructGPT's PPO-ptx mixing, arXiv 2203.02155 Eq. 2)."""
    loss, grads, metrics, _ = rl_part_gradients(state.params, batch, **loss_kw)
    anchor = None
    if _anchor_needed(anchor_coef, anchor_batch):
        anchor = sft_part_gradients(state.params, anchor_batch,
                                    model_config=loss_kw["model_config"],
                                    chunk_size=loss_kw["chunk_size"])[:3]
    return _finish_update(state, loss, grads, metrics, anchor, anchor_coef=anchor_coef)


def rl_part_gradients(
    params,
    batch: RLBatch,
    *,
    model_config,
    loss_config: ml_collections.ConfigDict,
    replay: str,
    chunk_size: int,
    zvp_alpha: float,
    n_micro: int,
    negative_scale: float = 1.0,
    fused: bool = False,
):
    """Loss, gradients and metrics of one part of an update's rows, and the part's weight in
    the loss's mean (`losses.aggregation_weight`). The learner computes the parts of an update
    at once, each on its own host thread (`train.grad_threads`), and `rl_apply_parts` joins
    them: the same update as `rl_train_step` on all the rows, as micro-batches give it."""
    loss_fn = functools.partial(
        rl_loss, model_config=model_config, loss_config=loss_config, replay=replay,
        chunk_size=chunk_size, zvp_alpha=zvp_alpha, negative_scale=negative_scale, fused=fused)
    mode = losses.aggregation_mode(loss_config)
    weight_fn = lambda mb: losses.aggregation_weight(mb.loss_mask, mode)  # noqa: E731
    loss, grads, metrics = accumulate_gradients(loss_fn, params, batch, n_micro, weight_fn,
                                                model_config)
    return loss, grads, metrics, weight_fn(batch).astype(jnp.float32)


def sft_part_gradients(params, batch, *, model_config, chunk_size: int):
    """`sft_loss`, its gradients and metrics on (a part of) the anchor's worked solutions, and
    the part's weight in the token mean (its answer tokens)."""
    (loss, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(
        params, batch, model_config=model_config, chunk_size=chunk_size)
    return loss, grads, metrics, jnp.sum(batch["mask"]).astype(jnp.float32)


def rl_apply_parts(state: TrainState, parts, anchor_parts=None, *, anchor_coef: float = 0.0):
    """One optimiser update from the `rl_part_gradients` of an update's parts and, with
    `anchor_coef` > 0, the `sft_part_gradients` of the anchor's parts (each joined by
    `join_parts`): the update `rl_train_step` makes on all the rows."""
    anchor = join_parts(anchor_parts) if _anchor_needed(anchor_coef, anchor_parts) else None
    loss, grads, metrics = join_parts(parts)
    return _finish_update(state, loss, grads, metrics, anchor, anchor_coef=anchor_coef)


def sft_loss(params, batch, *, model_config, chunk_size: int):
    """Token cross-entropy on `batch["targets"]` where `batch["mask"]` (plus the MoE aux loss)."""
    logp, _, out = sequence_logprobs(
        model_config, params, batch["tokens"], batch["positions"], batch["targets"], None,
        chunk_size,
    )
    nll = -_masked_mean(logp, batch["mask"])
    return nll + out.aux_loss, {"sft/nll": nll, "moe/aux_loss": out.aux_loss}


def sft_train_step(state: TrainState, batch, *, model_config, chunk_size: int, n_micro: int):
    """Supervised warm start: one update on `sft_loss`."""
    loss_fn = functools.partial(sft_loss, model_config=model_config, chunk_size=chunk_size)
    loss, grads, metrics = accumulate_gradients(
        loss_fn, state.params, batch, n_micro, weight_fn=lambda mb: mb["mask"].sum(),
        model_config=model_config)
    state, skipped = apply_gradients(state, grads, loss)
    metrics = dict(metrics)
    metrics["train/grad_norm"] = _global_norm(grads)
    metrics["train/skipped_update"] = skipped
    return state, metrics


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))
