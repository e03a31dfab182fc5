"""The two-level inverse-CDF draw (`sampling.categorical`) against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

from espo_jax.rollout import sampling


def _reference(x: np.ndarray, u: float) -> int:
    """The first token whose cumulative probability passes u (float64)."""
    p = np.exp(x - x.max())
    return int(np.searchsorted(np.cumsum(p) / p.sum(), u, side="right"))


def test_inverse_cdf_token_and_logsumexp_match_numpy():
    # 600 tokens: two full blocks of 256 and a padded one; a fifth of them at -inf
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, (8, 600)).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = -np.inf
    u = rng.random((50, 8)).astype(np.float32)
    draw = jax.jit(sampling.categorical)
    for row_u in u:
        tokens, lse = map(np.asarray, draw(jnp.asarray(x), jnp.asarray(row_u)))
        for b in range(8):
            p = np.exp(x[b].astype(np.float64) - x[b].max())
            cdf = np.cumsum(p) / p.sum()
            if np.min(np.abs(cdf - row_u[b])) < 1e-5:
                continue  # within fp32 rounding of a boundary: either neighbour is right
            assert tokens[b] == _reference(x[b].astype(np.float64), float(row_u[b]))
            assert np.isfinite(x[b, tokens[b]])
        np.testing.assert_allclose(lse, logsumexp(x.astype(np.float64), axis=-1), rtol=1e-6)


def test_a_draw_at_the_top_of_the_cdf_never_lands_on_a_zero_probability_token():
    x = np.full((3, 700), -np.inf, np.float32)
    x[0, :5] = 0.0  # only the first block has mass
    x[1, 300] = 1.0  # one token, in the middle block
    x[2, :] = 0.0
    x[2, 650:] = -np.inf  # the padded last block has mass only before 650
    u = np.full(3, np.nextafter(np.float32(1), np.float32(0)))  # the largest u below 1
    tokens, _ = sampling.categorical(jnp.asarray(x), jnp.asarray(u))
    assert np.asarray(tokens).tolist() == [4, 300, 649]


def test_frequencies_follow_the_softmax():
    n = 20000
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))
    u = jax.random.uniform(jax.random.key(0), (n,))
    tokens, _ = sampling.categorical(jnp.broadcast_to(logits, (n, 4)), u)
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.15, 0.1], atol=0.011)  # 3 sigma <= 0.011


@pytest.mark.parametrize("vocab", [1000, sampling.BLOCKWISE_MIN_VOCAB])  # each sampler
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_log_prob_is_the_log_softmax_of_the_drawn_token(temperature, vocab):
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 3, (6, vocab)).astype(np.float32))
    keys = jax.random.split(jax.random.key(2), 6)
    tokens, logp = sampling.sample(logits, keys, jnp.full(6, temperature), jnp.zeros(6, int),
                                   jnp.ones(6))
    want = jax.nn.log_softmax(logits, axis=-1)[jnp.arange(6), tokens]
    np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-5)
    if temperature == 0.0:
        assert np.asarray(tokens).tolist() == np.argmax(logits, axis=-1).tolist()


def test_small_vocabularies_draw_as_jax_random_categorical():
    """Below BLOCKWISE_MIN_VOCAB a key gives jax.random.categorical's token, bit for bit (the
    stored results of the tiny models were sampled so); from it, the inverse-CDF token of the
    key's uniform."""
    keys = jax.random.split(jax.random.key(3), 6)
    ones, zeros = jnp.ones(6), jnp.zeros(6, int)
    for vocab in (64, sampling.BLOCKWISE_MIN_VOCAB):
        logits = jax.random.normal(jax.random.key(4), (6, vocab))
        tokens, _ = sampling.sample(logits, keys, ones, zeros, ones)
        gumbel = jax.vmap(jax.random.categorical)(keys, logits)
        u = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)
        inverse_cdf, _ = sampling.categorical(logits, u)
        want = gumbel if vocab < sampling.BLOCKWISE_MIN_VOCAB else inverse_cdf
        assert np.asarray(tokens).tolist() == np.asarray(want).tolist()
