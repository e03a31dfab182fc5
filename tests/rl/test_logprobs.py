"""Chunked log-probs and entropies: hand values, chunked == unchunked, bounded memory."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from espo_jax.rl.logprobs import logprobs_from_hidden, token_logprobs_and_entropy


def test_hand_values():
    # V = 2, logits (0, ln 3): p = (1/4, 3/4); log p(1) = ln 0.75 = -0.287682;
    # H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335.
    # V = 5 uniform: log p = -ln 5, H = ln 5. Temperature 2 on (0, 2 ln 3) gives case one again.
    logits = jnp.array([[[0.0, math.log(3.0)]]])
    logp, ent = token_logprobs_and_entropy(logits, jnp.array([[1]]))
    assert logp[0, 0] == pytest.approx(math.log(0.75), rel=1e-6)
    assert ent[0, 0] == pytest.approx(0.562335, rel=1e-5)
    logp, ent = token_logprobs_and_entropy(jnp.zeros((1, 1, 5)), jnp.array([[3]]))
    assert logp[0, 0] == pytest.approx(-math.log(5), rel=1e-6)
    assert ent[0, 0] == pytest.approx(math.log(5), rel=1e-6)
    logp, ent = token_logprobs_and_entropy(2 * logits, jnp.array([[1]]), temperature=2.0)
    assert logp[0, 0] == pytest.approx(math.log(0.75), rel=1e-6)
    assert ent[0, 0] == pytest.approx(0.562335, rel=1e-5)


def test_minus_inf_logits_give_finite_values_and_gradients():
    # Two live entries of four: p = (1/2, 1/2, 0, 0): H = ln 2, log p(0) = -ln 2.
    logits = jnp.array([[[0.0, 0.0, -jnp.inf, -jnp.inf]]])

    def f(z):
        logp, ent = token_logprobs_and_entropy(z, jnp.array([[0]]))
        return logp.sum() + ent.sum(), (logp, ent)

    (_, (logp, ent)), grad = jax.value_and_grad(f, has_aux=True)(logits)
    assert logp[0, 0] == pytest.approx(-math.log(2), rel=1e-6)
    assert ent[0, 0] == pytest.approx(math.log(2), rel=1e-6)
    # d log p(0) / dz = onehot - p = (1/2, -1/2, 0, 0); dH/dz_v = -p_v (log p_v + H) = 0 here.
    np.testing.assert_allclose(grad[0, 0], [0.5, -0.5, 0.0, 0.0], atol=1e-6)


def _reference(logits, targets):
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logq, targets[..., None], axis=-1)[..., 0]
    return logp, -(jnp.exp(logq) * logq).sum(-1)


B_, T_, D_, V_ = 2, 7, 4, 11  # T = 7: chunk 3 leaves a tail of 1; 16 exceeds T


def _scalar(fn, cot, *args):
    """A random linear functional of (logp, entropy), so one gradient checks both."""
    logp, ent = fn(*args)
    return (cot[0] * logp).sum() + (cot[1] * ent).sum(), (logp, ent)


@pytest.fixture(scope="module")
def case():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    hidden = jax.random.normal(k1, (B_, T_, D_))
    w = jax.random.normal(k2, (D_, V_))
    targets = jax.random.randint(k3, (B_, T_), 0, V_)
    cot = jax.random.normal(k4, (2, B_, T_))
    ref = functools.partial(_scalar, lambda h, w_: _reference(h @ w_, targets), cot)
    (_, want), g_want = jax.jit(jax.value_and_grad(ref, (0, 1), has_aux=True))(hidden, w)
    ref_z = functools.partial(_scalar, lambda z: _reference(z, targets), cot)
    g_want_z = jax.jit(jax.grad(lambda z: ref_z(z)[0]))(hidden @ w)
    return dict(
        hidden=hidden, w=w, targets=targets, cot=cot, want=want, g_want=g_want, g_want_z=g_want_z
    )


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_chunked_equals_unchunked_values_and_gradients(chunk_size, case):
    targets, cot, want = case["targets"], case["cot"], case["want"]
    from_logits = functools.partial(
        _scalar, lambda z: token_logprobs_and_entropy(z, targets, chunk_size=chunk_size), cot
    )
    (_, got), g_got = jax.jit(jax.value_and_grad(from_logits, has_aux=True))(
        case["hidden"] @ case["w"]
    )
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_got, case["g_want_z"], rtol=1e-5, atol=1e-6)

    from_hidden = functools.partial(
        _scalar, lambda h, w_: logprobs_from_hidden(h, w_, targets, chunk_size=chunk_size), cot
    )
    (_, got), g_got = jax.jit(jax.value_and_grad(from_hidden, (0, 1), has_aux=True))(
        case["hidden"], case["w"]
    )
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_got, case["g_want"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bf16_logits_are_reduced_in_fp32():
    logits = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 13)).astype(jnp.bfloat16) * 4
    targets = jnp.arange(10).reshape(2, 5)
    fn = jax.jit(functools.partial(token_logprobs_and_entropy, chunk_size=2))
    logp, ent = fn(logits, targets)
    assert logp.dtype == ent.dtype == jnp.float32
    want = jax.jit(_reference)(logits.astype(jnp.float32), targets)
    np.testing.assert_allclose(logp, want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, want[1], rtol=1e-6, atol=1e-6)


def test_gradients_match_finite_differences():
    with jax.enable_x64(True):
        k1, k2 = jax.random.split(jax.random.PRNGKey(2))
        hidden = jax.random.normal(k1, (1, 3, 2), jnp.float64)
        w = jax.random.normal(k2, (2, 5), jnp.float64)
        targets = jnp.array([[4, 0, 2]])

        @jax.jit
        def f(h, w_):
            logp, ent = logprobs_from_hidden(h, w_, targets, chunk_size=2, temperature=0.7)
            return logp.sum() + 0.5 * ent.sum()

        assert f(hidden, w).dtype == jnp.float64
        check_grads(f, (hidden, w), order=1, modes=("rev",), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_bad_inputs_are_named():
    z = jnp.zeros((1, 3, 4))
    with pytest.raises(ValueError, match=r"logits \[B, T, V\]"):
        token_logprobs_and_entropy(z, jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_and_entropy(z, jnp.zeros((1, 3), jnp.int32), chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(z, jnp.zeros((1, 3), jnp.int32), temperature=0.0)
    with pytest.raises(ValueError, match="matching D"):
        logprobs_from_hidden(z, jnp.zeros((5, 4)), jnp.zeros((1, 3), jnp.int32))


# Peak memory from the compiled program (XLA buffer assignment), no execution needed.
B, C, D = 2, 16, 16


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _hidden_objective(h, w, t, chunk):
    logp, ent = logprobs_from_hidden(h, w, t, chunk_size=chunk)
    return logp.sum() + ent.sum()


def _naive_objective(h, w, t):
    logp, ent = _reference(h @ w, t)
    return logp.sum() + ent.sum()


def _shapes(T, V, dtype=jnp.float32):
    return (
        jax.ShapeDtypeStruct((B, T, D), dtype),
        jax.ShapeDtypeStruct((D, V), dtype),
        jax.ShapeDtypeStruct((B, T), jnp.int32),
    )


def test_peak_memory_bounded_as_vocab_grows():
    chunked = functools.partial(_hidden_objective, chunk=C)
    grad = jax.grad(chunked, argnums=(0, 1))
    T = 512
    for V in (2048, 8192):
        full_fp32 = B * T * V * 4  # the [B, T, V] fp32 logits: 8 MB, 32 MB
        chunk_fp32 = B * C * V * 4  # one chunk of them, 1/32 of that
        fwd = _temp_bytes(chunked, *_shapes(T, V))
        bwd = _temp_bytes(grad, *_shapes(T, V))
        # Forward and backward hold a few chunks at a time, never the whole [B, T, V]:
        # temporaries grow with V only through the chunk, 8x below the full tensor.
        assert fwd <= 4 * chunk_fp32, (V, fwd, chunk_fp32)
        assert bwd <= 8 * chunk_fp32, (V, bwd, chunk_fp32)
        assert 8 * chunk_fp32 == full_fp32 / 4
    # bf16 weights and activations (fp32 accumulation per chunk): bounded the same way.
    assert _temp_bytes(grad, *_shapes(T, 8192, jnp.bfloat16)) <= 8 * chunk_fp32
    # The measurement sees a materialised [B, T, V]: the unchunked backward holds it.
    assert _temp_bytes(jax.grad(_naive_objective, (0, 1)), *_shapes(T, 8192)) >= full_fp32
    # Temporaries do not grow with the sequence: 4x the positions, about the same bytes.
    long_bwd = _temp_bytes(grad, *_shapes(4 * T, 8192))
    assert long_bwd <= 1.25 * bwd, (long_bwd, bwd)


def test_peak_memory_of_logits_path_is_chunked():
    # fp32 logits in (an argument, not a temporary): softmax temporaries are per chunk. The
    # backward's only [B, T, V] buffer is the gradient itself, filled chunk by chunk.
    V, T = 8192, 512
    shapes = (jax.ShapeDtypeStruct((B, T, V), jnp.float32), jax.ShapeDtypeStruct((B, T), jnp.int32))

    def objective(z, t):
        logp, ent = token_logprobs_and_entropy(z, t, chunk_size=C)
        return logp.sum() + ent.sum()

    full_fp32, chunk_fp32 = B * T * V * 4, B * C * V * 4  # 32 MB, 1 MB
    assert _temp_bytes(objective, *shapes) <= 4 * chunk_fp32
    assert _temp_bytes(jax.grad(objective), *shapes) <= full_fp32 + 8 * chunk_fp32
