"""Flat metrics of a per-token quantity over a response mask: mean, extremes and quantiles.

`policy_loss` reports the importance ratio this way (`is_ratio/*`) and truncated importance
sampling its weights (`tis/weight_*`); both read only the valid tokens, and a batch without one
reports `neutral` rather than a NaN or an infinity.
"""

import jax.numpy as jnp


def masked_stats(x, mask, prefix, neutral=1.0):
    """`{prefix}mean`, `{prefix}min`, `{prefix}max` over valid tokens (`neutral` if none)."""
    valid = mask > 0
    count = jnp.maximum(valid.sum(), 1)
    any_valid = valid.any()
    return {
        f"{prefix}mean": jnp.where(valid, x, 0.0).sum() / count,
        f"{prefix}min": jnp.where(any_valid, jnp.where(valid, x, jnp.inf).min(), neutral),
        f"{prefix}max": jnp.where(any_valid, jnp.where(valid, x, -jnp.inf).max(), neutral),
    }


def masked_quantiles(x, mask, prefix, qs, neutral=1.0):
    """`{prefix}p{100 q}` over valid tokens (`neutral` if none): the ratio's tails."""
    valid = mask > 0
    vals = jnp.nanquantile(jnp.where(valid, x, jnp.nan).reshape(-1), jnp.asarray(qs))
    vals = jnp.where(valid.any(), vals, neutral)
    return {f"{prefix}p{round(100 * q):02d}": vals[i] for i, q in enumerate(qs)}
