"""`ModelConfig.attention_impl`: jax.nn.dot_product_attention in place of espo_jax's einsums.

On CPU "dpa" runs JAX's XLA implementation; it must give the "xla" path's log-probs and
gradients on packed rows with a shared prompt prefix and padding. "cudnn" is GPU-only: here it
must fail when traced, with an error (launch/device_check.sh records it on a GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.models import forward, get_preset, init_params
from espo_jax.models.attention import PREFIX_STRIDE

# One row: a 3-token shared prefix (segment S), two members (S + 1, S + 2) continuing its
# positions, then 2 padding tokens; a second row: one plain sequence of 6 and padding.
S = PREFIX_STRIDE
SEGMENTS = np.array([[S, S, S, S + 1, S + 1, S + 2, S + 2, S + 2, 0, 0],
                     [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]], np.int32)
POSITIONS = np.array([[0, 1, 2, 3, 4, 3, 4, 5, 0, 0],
                      [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]], np.int32)


def _loss(config, params, tokens):
    out = forward(config, params, tokens, positions_BxT=POSITIONS, segment_ids_BxT=SEGMENTS)
    logp = jax.nn.log_softmax(out.logits.astype(jnp.float32))
    real = SEGMENTS[:, 1:] > 0
    nll = -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * real) / real.sum(), logp


def test_dpa_matches_xla_attention_on_packed_rows():
    xla = get_preset("tiny")
    params = init_params(xla, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), SEGMENTS.shape, 0, xla.vocab_size)
    grad = jax.jit(jax.value_and_grad(_loss, argnums=1, has_aux=True), static_argnums=0)
    (loss_x, logp_x), g_x = grad(xla, params, tokens)
    (loss_d, logp_d), g_d = grad(xla.replace(attention_impl="dpa"), params, tokens)
    real = SEGMENTS > 0
    np.testing.assert_allclose(np.asarray(logp_d)[real], np.asarray(logp_x)[real], atol=1e-5)
    np.testing.assert_allclose(float(loss_d), float(loss_x), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_d), jax.tree.leaves(g_x), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)
    # the mask is the packing's: a member that could see the other member would change logits
    leaky = SEGMENTS.copy()
    leaky[0, 5:8] = S + 1
    out = forward(xla.replace(attention_impl="dpa"), params, tokens, positions_BxT=POSITIONS,
                  segment_ids_BxT=leaky)
    leaked = np.asarray(jax.nn.log_softmax(out.logits[0, 5:8].astype(jnp.float32)))
    assert not np.allclose(leaked, np.asarray(logp_d[0, 5:8]), atol=1e-3)


def test_attention_impl_is_validated():
    with pytest.raises(ValueError, match="attention_impl 'flash' is not one of"):
        get_preset("tiny", attention_impl="flash")
    with pytest.raises(ValueError, match="takes GQA attention"):
        get_preset("tiny_deepseek_v3", attention_impl="dpa")
    with pytest.raises(ValueError, match="attention_chunk 8"):
        get_preset("tiny", attention_impl="cudnn", attention_chunk=8)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN runs on a GPU")
def test_cudnn_off_gpu_is_an_error_when_traced():
    config = get_preset("tiny", attention_impl="cudnn", dtype="bfloat16")
    params = init_params(get_preset("tiny"), jax.random.key(0))
    tokens = jnp.ones(SEGMENTS.shape, jnp.int32)
    with pytest.raises(Exception, match="(?i)cudnn"):  # JAX's error type varies by version
        jax.jit(lambda p: _loss(config, p, tokens)[0])(params)
