"""KV cache: prefill + one-token decode steps (each row at its own position, as continuous
batching runs it) give the teacher-forced forward's logits and routing; slots are reusable."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.models import forward, get_preset, init_cache

TINY = get_preset("tiny")
S = 24  # cache slots
LENS = (12, 9)  # full lengths of the two rows
PROMPTS = (5, 3)  # prompt lengths: the rows decode at different positions
POSITIONS = jnp.broadcast_to(jnp.arange(12), (2, 12))


@pytest.fixture(scope="module")
def step(jit):
    """One jitted function for prefill ([2, 5]) and decode ([2, 1]) calls."""
    return jit(functools.partial(forward, TINY))


@pytest.fixture(scope="module")
def seqs():
    return jax.random.randint(jax.random.key(9), (2, 12), 0, TINY.vocab_size)


@pytest.fixture(scope="module")
def reference(fwd, tiny_params, seqs):
    """Teacher-forced forward of both rows (row 1 right-padded)."""
    mask = jnp.arange(12)[None] < jnp.array(LENS)[:, None]
    return fwd(TINY, tiny_params, seqs, positions_BxT=POSITIONS, attention_mask_BxT=mask)


@pytest.fixture(scope="module")
def decoded(step, tiny_params, seqs):
    """Prefill the prompts (row 1 right-padded), then decode token by token; returns the
    logits and experts per (row, position) and the final cache and mask."""
    cache = init_cache(TINY, 2, S)
    cache_mask = np.zeros((2, S), bool)
    prompt_mask = np.arange(5)[None] < np.array(PROMPTS)[:, None]
    out = step(tiny_params, seqs[:, :5], attention_mask_BxT=prompt_mask, cache=cache,
               cache_mask_BxS=cache_mask)
    logits = {(b, t): out.logits[b, t] for b in range(2) for t in range(PROMPTS[b])}
    experts = {(b, t): out.routed_experts[b, t] for b in range(2) for t in range(PROMPTS[b])}
    cache = out.cache
    cache_mask[0, :5], cache_mask[1, :3] = True, True
    pos = np.array(PROMPTS)
    while (pos < np.array(LENS)).any():
        active = pos < np.array(LENS)
        p = np.minimum(pos, 11)
        out = step(tiny_params, seqs[np.arange(2), p][:, None], positions_BxT=p[:, None],
                   attention_mask_BxT=active[:, None], cache=cache, cache_mask_BxS=cache_mask)
        cache = out.cache
        for b in np.flatnonzero(active):
            logits[(b, p[b])] = out.logits[b, 0]
            experts[(b, p[b])] = out.routed_experts[b, 0]
            cache_mask[b, p[b]] = True
        pos = pos + active
    return logits, experts, cache, cache_mask


def test_init_cache_layout():
    cache = init_cache(TINY, 3, 12, jnp.bfloat16)
    assert set(cache) == {"layers_0", "layers_1"}
    assert cache["layers_1"]["k"].shape == (3, 2, TINY.head_dim, 12)  # [B, K, A, S]
    assert cache["layers_1"]["v"].shape == (3, 2, 12, TINY.head_dim)  # [B, K, S, A]
    assert cache["layers_1"]["k"].dtype == cache["layers_1"]["v"].dtype == jnp.bfloat16


def test_cached_decode_equals_full_forward(decoded, reference, step):
    logits, experts, _, _ = decoded
    assert len(logits) == sum(LENS)
    for (b, t), row in logits.items():
        np.testing.assert_allclose(row, reference.logits[b, t], atol=1e-5, err_msg=f"{b},{t}")
        np.testing.assert_array_equal(experts[(b, t)], reference.routed_experts[b, t])
    # static shapes: one compilation for the prefill and one for all decode steps
    assert step._cache_size() == 2


def test_padding_tokens_are_not_written(decoded):
    _, _, cache, cache_mask = decoded
    # row 1 holds 9 tokens; slots 9.. were never written (still zero)
    keys_KxAxS, values_KxSxA = (np.asarray(cache["layers_0"][n][1]) for n in "kv")
    np.testing.assert_array_equal(keys_KxAxS[:, :, 9:], 0.0)
    np.testing.assert_array_equal(values_KxSxA[:, 9:], 0.0)
    assert np.abs(keys_KxAxS[:, :, :9]).min(axis=(0, 1)).all()
    assert np.abs(values_KxSxA[:, :9]).min(axis=(0, 2)).all()
    np.testing.assert_array_equal(cache_mask.sum(1), LENS)


def test_slot_reuse_for_a_new_sequence(step, decoded, tiny_params, fwd):
    """Continuous batching: row 1 starts a new sequence (mask reset) while row 0 sits idle
    (attention_mask False: nothing of row 0 is written)."""
    _, _, cache, cache_mask = decoded
    cache_mask = cache_mask.copy()
    cache_mask[1] = False
    new = jax.random.randint(jax.random.key(10), (1, 5), 0, TINY.vocab_size)
    tokens = jnp.concatenate([jnp.zeros((1, 5), jnp.int32), new])
    active = np.array([[False] * 5, [True] * 5])
    out = step(tiny_params, tokens, attention_mask_BxT=active, cache=cache,
               cache_mask_BxS=cache_mask)
    # reference: the new sequence alone (right-padded to the shared [2, 12] shape)
    fresh = fwd(TINY, tiny_params, jnp.zeros((2, 12), jnp.int32).at[0, :5].set(new[0]),
                positions_BxT=POSITIONS, attention_mask_BxT=POSITIONS < 5)
    np.testing.assert_allclose(out.logits[1], fresh.logits[0, :5], atol=1e-5)
    for i in range(TINY.n_layers):
        for name in "kv":
            np.testing.assert_array_equal(out.cache[f"layers_{i}"][name][0],
                                          cache[f"layers_{i}"][name][0])


def test_cache_needs_a_mask(tiny_params, seqs):
    with pytest.raises(ValueError, match="needs cache_mask_BxS"):
        forward(TINY, tiny_params, seqs[:, :1], cache=init_cache(TINY, 2, S))
    with pytest.raises(ValueError, match=r"cache_mask_BxS has shape \(2, 5\), expected \(2, 24\)"):
        forward(TINY, tiny_params, seqs[:, :1], cache=init_cache(TINY, 2, S),
                cache_mask_BxS=np.zeros((2, 5), bool))


@pytest.mark.parametrize("t", [1, 3])
def test_attend_keys_either_key_layout(t):
    """The cache's [B, K, A, S] keys give the attention [B, K, S, A] keys give, for a decode
    step (T = 1) and for a prefill (T > 1); the keys are given in exactly one layout."""
    from espo_jax.models.attention import attend_keys

    b, kv, g, a, s = 2, 2, 2, 8, 6
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in
               enumerate([(b, t, kv, g, a), (b, kv, s, a), (b, kv, s, a)]))
    positions = jnp.array([[3], [5]]) + jnp.arange(t) - (t - 1)
    common = dict(values_BxKxSxA=v, key_pos_BxS=jnp.broadcast_to(jnp.arange(s), (b, s)),
                  key_valid_BxS=jnp.arange(s)[None] != 1, dtype=jnp.float32)
    out = attend_keys(q, positions, keys_BxKxSxA=k, **common)
    out_t = attend_keys(q, positions, keys_BxKxAxS=jnp.swapaxes(k, 2, 3), **common)
    np.testing.assert_allclose(out_t, out, rtol=1e-6, atol=1e-6)
    # by hand: row 0's last query sees slots 0, 2, 3 (slot 1 invalid, 4-5 later positions)
    seen = np.array([0, 2, 3])
    scores = np.einsum("ga,sa->gs", q[0, -1, 0], k[0, 0, seen]) / np.sqrt(a)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(out[0, -1, 0], (p / p.sum(-1, keepdims=True)) @ v[0, 0, seen],
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="exactly one"):
        attend_keys(q, positions, keys_BxKxSxA=k, keys_BxKxAxS=jnp.swapaxes(k, 2, 3), **common)


def test_a_bf16_cache_on_cpu_holds_fp32_the_same_numbers(tiny_params, seqs):
    """On CPU a bf16 model's cache holds its keys and values in fp32 (`kv_cache_dtype`: XLA:CPU
    scatters bf16 by converting the whole cache), every entry a bf16 number; a prefill and
    three decode steps read from it give the logits of a bf16 cache (the products take bf16
    inputs and sum in fp32 either way) and the same next tokens."""
    from espo_jax.models.transformer import kv_cache_dtype

    config = TINY.replace(dtype="bfloat16")
    assert kv_cache_dtype(config) == (jnp.float32 if jax.default_backend() == "cpu"
                                      else jnp.bfloat16)
    assert kv_cache_dtype(TINY) == jnp.float32
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_params)
    step = jax.jit(functools.partial(forward, config))

    def run(cache):
        mask = np.zeros((2, S), bool)
        out = step(params, seqs[:, :5], cache=cache, cache_mask_BxS=mask)
        logits, mask[:, :5] = [out.logits[:, -1]], True
        for p in range(5, 8):
            out = step(params, seqs[:, p:p + 1], positions_BxT=jnp.full((2, 1), p),
                       cache=out.cache, cache_mask_BxS=mask)
            logits.append(out.logits[:, 0])
            mask[:, p] = True
        return np.stack(logits), out.cache

    wide, wide_cache = run(init_cache(config, 2, S))
    narrow, narrow_cache = run(init_cache(config, 2, S, jnp.bfloat16))
    k = wide_cache["layers_1"]["k"]
    assert k.dtype == kv_cache_dtype(config)
    np.testing.assert_array_equal(k, k.astype(jnp.bfloat16).astype(k.dtype))
    assert float(jnp.max(jnp.abs(k[:, :, :, :8]))) > 0
    np.testing.assert_allclose(np.asarray(k, np.float32),
                               np.asarray(narrow_cache["layers_1"]["k"], np.float32),
                               rtol=0, atol=0.02 * float(jnp.max(jnp.abs(k))))
    np.testing.assert_allclose(wide, narrow, rtol=0, atol=0.02 * float(np.max(np.abs(narrow))))
    np.testing.assert_array_equal(wide.argmax(-1), narrow.argmax(-1))
