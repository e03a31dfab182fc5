"""Reducing per-token values `[B, T]` to the scalar a loss minimises (the `aggregation` modes
of the loss config), and each mode's micro-batch weight so gradient accumulation is exact."""

import jax
import jax.numpy as jnp

# The modes of `aggregate`.
AGGREGATION_MODES = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "group_mean",
)


def aggregation_weight(mask_BxT: jax.Array, mode: str) -> jax.Array:
    """The denominator of `aggregate` for this mask: valid tokens for `token_mean`, non-empty
    rows otherwise. Summing w_b * aggregate(x_b) over micro-batches b and dividing by sum_b w_b
    gives exactly `aggregate` of the whole batch (each mode is a ratio of sums)."""
    n = mask_BxT.astype(jnp.float32).sum(axis=1)
    if mode == "token_mean":
        return n.sum()
    return (n > 0).astype(jnp.float32).sum()


def aggregate(x_BxT, mask_BxT, mode: str, *, norm_len: int = 0, group_weights=None):
    """Reduce per-token values to a scalar. Rows with no valid token are left out of row means.

    token_mean               sum_{i,t} x / sum_i |y_i|
    seq_mean_token_mean      mean_i (1/|y_i| sum_t x)
    seq_mean_token_sum       mean_i sum_t x
    seq_mean_token_sum_norm  mean_i (sum_t x / L), L = norm_len or T (Dr. GRPO)
    group_mean               mean_i sum_t w_t x, w = 1 / (|groups_i| |tau(t)|)  (ESPO Eq. 5)
    """
    m = mask_BxT.astype(jnp.float32)
    x = jnp.where(m > 0, x_BxT, 0.0)
    n = m.sum(axis=1)
    if mode == "token_mean":
        return (x * m).sum() / jnp.maximum(n.sum(), 1.0)
    if mode == "seq_mean_token_mean":
        rows = (x * m).sum(axis=1) / jnp.maximum(n, 1.0)
    elif mode == "seq_mean_token_sum":
        rows = (x * m).sum(axis=1)
    elif mode == "seq_mean_token_sum_norm":
        rows = (x * m).sum(axis=1) / float(norm_len or x_BxT.shape[1])
    elif mode == "group_mean":
        if group_weights is None:
            raise ValueError("aggregation 'group_mean' needs ESPO group weights (loss 'espo')")
        rows = (x * group_weights).sum(axis=1)
    else:
        raise ValueError(f"unknown aggregation {mode!r}")
    nonempty = (n > 0).astype(jnp.float32)
    return (rows * nonempty).sum() / jnp.maximum(nonempty.sum(), 1.0)
