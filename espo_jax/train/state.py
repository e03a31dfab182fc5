"""Train state and optimiser: AdamW with linear warm-up + cosine decay and global-norm clipping.

The learner's parameters are float32 masters whatever the checkpoint's dtype
(`run_setup.MASTER_DTYPE`); the model computes in `ModelConfig.dtype` (bf16 at scale) by casting
each weight where it is used, so gradients arrive in float32. At the paper's lr 1e-6 an update
of a bf16 weight of scale 0.02 rounds away for most elements (bf16 keeps 8 significant bits: a
change below 2^-9 of the weight is lost); the fp32 master keeps it. The moments are float32 by
default, bf16 with `optim.moment_dtype` (both moments stored in bf16, updated in float32).
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax

from espo_jax.models import scan


@flax.struct.dataclass
class TrainState:
    """Everything the pure train step reads and writes.

    `step` counts update attempts, skipped ones included; `skipped` counts updates dropped for
    a non-finite loss or gradient. The learning-rate schedule follows the optimiser's own
    count in `opt_state`, which a skipped update leaves unchanged (like every other moment).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    skipped: jax.Array
    rng: jax.Array
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)


def make_schedule(optim: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to `optim.lr`, then cosine decay to `lr * final_lr_frac`."""
    warmup = min(optim.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=optim.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=optim.lr * optim.final_lr_frac,
    )


def make_optimizer(
    optim: ml_collections.ConfigDict, total_steps: int
) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; weight decay only on matrices (not norms or biases):
    a layer's own matrices, the leading repeats axis of a scanned run (`models.scan`) not
    counted."""

    def decay_mask(params):
        def is_matrix(path, p):
            stacked = any(str(getattr(k, "key", "")).startswith(scan.PREFIX) for k in path)
            return p.ndim - stacked >= 2

        return jax.tree_util.tree_map_with_path(is_matrix, params)

    moment_dtype = jnp.dtype(optim.moment_dtype)
    tx = optax.chain(
        optax.clip_by_global_norm(optim.grad_clip_norm),
        optax.adamw(
            make_schedule(optim, total_steps),
            b1=optim.b1,
            b2=optim.b2,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            mask=decay_mask,
            mu_dtype=moment_dtype,
        ),
    )
    if moment_dtype == jnp.float32:
        return tx
    # optax keeps the second moment in the dtype it was initialised in (and computes its update
    # in float32): initialising from the parameters cast to `moment_dtype` stores both moments
    # narrow. Nothing else in the chain keeps per-parameter state.
    return optax.GradientTransformation(
        lambda params: tx.init(optax.tree.cast(params, moment_dtype)), tx.update)


def create_train_state(params, tx: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    return TrainState(
        params=params,
        opt_state=tx.init(params),
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        rng=rng,
        tx=tx,
    )


def apply_gradients(state: TrainState, grads, loss: jax.Array) -> tuple[TrainState, jax.Array]:
    """One optimiser update, skipped (parameters and moments unchanged) if loss or grads are
    not finite. Returns the new state and a 0/1 `skipped` flag.

    The skip is one `lax.cond` around the update. A per-array `where(finite, new, old)` gives
    the same values bit for bit compiled alone (inside a larger program fusion may order the
    floats differently), but XLA:CPU compiled it slowly: for SmolLM2-135M's 272 arrays 61 s and
    ~2 GB of compiler memory against 5 s, and the donated update ran 553 against 310 ms
    (experiments/arith_common.py, "Recipe log")."""
    finite = jnp.isfinite(loss) & jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
    )

    def update(_):
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    params, opt_state = jax.lax.cond(
        finite, update, lambda _: (state.params, state.opt_state), None)
    skipped = (~finite).astype(jnp.int32)
    return (
        state.replace(
            params=params,
            opt_state=opt_state,
            step=state.step + 1,
            skipped=state.skipped + skipped,
        ),
        skipped,
    )
