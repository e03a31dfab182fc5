"""Group-relative advantages from rewards `[N, G]` (N prompts, G responses each).

Small `jnp` functions, each with its formula. `rl_zvp` is MS-ZVE's actor-update stage: groups
whose rewards carry no contrast get entropy-shaped per-token advantages instead of zeros.
`zero_variance` (the zero-variance predicate) and `zvp_signs` (RL-ZVP's per-group sign) are
the only definitions of both in the code base: written with array methods, they serve numpy
callers (the learner, `espo_jax.zve`'s online filter and metrics) and JAX ones alike.
Shapes: N prompt groups, G responses per group, T token positions.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def grpo(rewards_NxG: jax.Array, eps: float = 1e-6) -> jax.Array:
    """A_i = (R_i - mean_j R_j) / (std_j R_j + eps), std over the group with ddof=0.

    A zero-variance group gets A = 0 exactly (numerator 0).
    """
    r = jnp.asarray(rewards_NxG, jnp.float32)
    centred = r - r.mean(axis=-1, keepdims=True)
    return centred / (r.std(axis=-1, keepdims=True) + eps)


def dr_grpo(rewards_NxG: jax.Array) -> jax.Array:
    """Dr. GRPO: A_i = R_i - mean_j R_j (no std division, which biases towards easy/hard groups)."""
    r = jnp.asarray(rewards_NxG, jnp.float32)
    return r - r.mean(axis=-1, keepdims=True)


def rloo(rewards_NxG: jax.Array) -> jax.Array:
    """Leave-one-out baseline: A_i = R_i - mean_{j != i} R_j = G/(G-1) * (R_i - mean_j R_j)."""
    r = jnp.asarray(rewards_NxG, jnp.float32)
    g = r.shape[-1]
    if g < 2:
        raise ValueError(f"rloo needs at least 2 responses per group, got G={g}")
    return (r - r.mean(axis=-1, keepdims=True)) * (g / (g - 1))


ADVANTAGES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
}


def zero_variance(values_NxG, atol: float = 0.0):
    """Bool `[N]`: True where every response of the group has the same value (max == min, or
    max - min <= atol for a Python float atol > 0, which needs numeric values).

    THE zero-variance predicate: RL-ZVP (`zvp_signs`, `rl_zvp`), the learner's signs, MS-ZVE's
    online filter and its metrics all call it. Array methods only, so numpy arrays give numpy
    and JAX arrays JAX (no dtype cast: pass what is to be compared). Pass binary outcomes for
    MS-ZVE filtering (never a shaped score), rewards to ask whether group normalisation has any
    contrast left. Groups of different sizes: call it per group on `values[None]`.
    """
    hi, lo = values_NxG.max(axis=-1), values_NxG.min(axis=-1)
    if atol == 0.0:
        return hi == lo
    return (hi == lo) | (hi - lo <= atol)


def zvp_signs(rewards_NxG, outcomes_NxG, wrong_groups: bool = True):
    """int32 `[N]` RL-ZVP sign per group: +1 for a zero-variance group whose responses are all
    correct (outcome > 0), -1 for an all-wrong one (only with `wrong_groups`; without it an
    all-wrong group keeps its zero group advantage), 0 otherwise.

    A group is zero-variance when its rewards are all equal (no contrast for the base advantage)
    AND its binary outcomes are all equal: a group whose shaped rewards differ (MS-ZVE stage 2
    broke the tie) is not. Array methods only, like `zero_variance` (numpy or JAX in, same out).
    """
    correct = outcomes_NxG > 0
    zv = zero_variance(rewards_NxG) & zero_variance(correct)
    right = zv & correct.all(axis=-1)
    wrong = zv & ~correct.any(axis=-1) & bool(wrong_groups)
    return right.astype("int32") - wrong.astype("int32")


def rl_zvp(
    rewards_NxG: jax.Array,
    outcomes_NxG: jax.Array,
    entropy_NxGxT: jax.Array,
    mask_NxGxT: jax.Array,
    alpha: float,
    *,
    base: str = "grpo",
) -> jax.Array:
    """RL-ZVP per-token advantages `[N, G, T]` (arXiv 2509.21880, Eq. 5).

    A group is zero-variance when its rewards are all equal (no contrast for `base`) and its
    outcomes are all equal; then, with H the (old-policy) token entropy, constant here:
      all correct (outcome > 0):  A_t = +alpha * sg(H_t)
      all wrong:                  A_t = -alpha * (max_{t' in y_i} H_t' - sg(H_t))
    Every other group gets ADVANTAGES[base](rewards) broadcast over its tokens. Masked tokens
    get 0. A group whose shaped rewards differ (MS-ZVE stage 2 broke the tie) is not zero-variance.
    The signs are `zvp_signs` (rewards compared in float32).
    """
    if base not in ADVANTAGES:
        raise ValueError(f"unknown base advantage {base!r}; valid: {sorted(ADVANTAGES)}")
    if entropy_NxGxT.shape != mask_NxGxT.shape or entropy_NxGxT.shape[:2] != rewards_NxG.shape:
        raise ValueError(
            f"expected rewards [N, G], entropy and mask [N, G, T]; got {rewards_NxG.shape}, "
            f"{entropy_NxGxT.shape}, {mask_NxGxT.shape}"
        )
    if outcomes_NxG.shape != rewards_NxG.shape:
        raise ValueError(f"outcomes {outcomes_NxG.shape} must match rewards {rewards_NxG.shape}")
    signs = zvp_signs(jnp.asarray(rewards_NxG, jnp.float32), jnp.asarray(outcomes_NxG))
    sign_NxG = jnp.broadcast_to(signs[:, None], rewards_NxG.shape)
    base_NxGxT = jnp.broadcast_to(ADVANTAGES[base](rewards_NxG)[:, :, None], mask_NxGxT.shape)
    return zvp_token_advantages(base_NxGxT, sign_NxG, entropy_NxGxT, mask_NxGxT, alpha)


def zvp_token_advantages(base_xT: jax.Array, sign_x: jax.Array, entropy_xT: jax.Array,
                         mask_xT: jax.Array, alpha: float) -> jax.Array:
    """RL-ZVP's token formula, for sequences laid out any way (`[..., T]`): where `sign_x` is
    +1 (the sequence's group is all correct) A_t = alpha * sg(H_t); where -1 (all wrong)
    A_t = -alpha * (max_t' H_t' - sg(H_t)), the max over the sequence's unmasked tokens;
    where 0, `base_xT`. Masked tokens get 0. `rl_zvp` ([N, G, T] groups) and the learner's
    packed rows (`train.step.token_advantages`) both use it."""
    valid = mask_xT > 0
    h = jnp.where(valid, jax.lax.stop_gradient(entropy_xT.astype(jnp.float32)), 0.0)
    h_max = jnp.where(valid, h, -jnp.inf).max(axis=-1, keepdims=True)
    h_max = jnp.where(jnp.isfinite(h_max), h_max, 0.0)
    sign = sign_x[..., None]
    zvp = jnp.where(sign > 0, alpha * h, -alpha * (h_max - h))
    return jnp.where(valid, jnp.where(sign != 0, zvp, base_xT), 0.0)


def overlong_penalty(lengths: jax.Array, max_len: int, cache_len: int) -> jax.Array:
    """DAPO soft overlong punishment, added to the reward of each response:

    0                                 if |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
    -1                                if |y| > L_max
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    n = jnp.asarray(lengths, jnp.float32)
    soft = max_len - cache_len
    ramp = (soft - n) / cache_len
    return jnp.where(n <= soft, 0.0, jnp.where(n <= max_len, ramp, -1.0))
