"""The token-by-token gated delta rule: the oracle `chunk_gated_delta_rule` is tested against
(the model runs the chunked form; a decode step is `gated_deltanet.recurrent_step`)."""

import jax
import jax.numpy as jnp

from espo_jax.models.gated_deltanet import history, recurrent_step


def recurrent_gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH,
                               segments_BxT, state_BxHxKxV=None):
    """The token-by-token form of `gated_deltanet.chunk_gated_delta_rule` (its arguments but
    the chunk): `recurrent_step` in a `lax.scan`; where the segment id changes the state
    restarts from zero, or for a shared prefix's member from the state after the latest prefix
    token."""
    b, t, h, dk = k_BxTxHxK.shape
    s0 = (jnp.zeros((b, h, dk, v_BxTxHxV.shape[-1]), jnp.float32) if state_BxHxKxV is None
          else state_BxHxKxV.astype(jnp.float32))
    prev = jnp.concatenate([segments_BxT[:, :1], segments_BxT[:, :-1]], axis=1)
    hist = history(segments_BxT)
    keep = (segments_BxT == prev).astype(jnp.float32)
    from_pref = ((segments_BxT != prev) & hist["member"]).astype(jnp.float32)

    def step(carry, xs):
        s, s_pref = carry
        q, k, v, g, beta, keep_B, pref_B, is_prefix = xs
        s_in = s * keep_B[:, None, None, None] + s_pref * pref_B[:, None, None, None]
        o, s_new = recurrent_step(q, k, v, g, beta, s_in)
        return (s_new, jnp.where(is_prefix[:, None, None, None], s_new, s_pref)), o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH,
                                               beta_BxTxH, keep, from_pref, hist["is_prefix"]))
    (s, _), o = jax.lax.scan(step, (s0, jnp.zeros_like(s0)), xs)
    return jnp.moveaxis(o, 0, 1), s
