"""The rollout engine against the learner's forward: greedy = teacher-forced argmax, cached logits =
recomputed, fp32 log-probs and experts = learner's, FP8 + replay, continuous batching, sampling.

One fp32 engine and one FP8 engine (tiny model) are compiled for the module; sampling settings
are per-slot arrays, so greedy and sampled runs share the compiled step.
"""

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax import models
from espo_jax.rollout import batching, decode, mismatch, scheduling
from espo_jax.rollout import engine as engine_lib
from espo_jax.rollout.decode import FREE
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.rollout.sampling import sample as sample_eager
from espo_jax.rollout.sampling import truncated_logits as truncated_eager

CONFIG = models.get_preset("tiny")
SLOTS, CACHE, SYNC = 4, 64, 4
truncated_logits, sample = jax.jit(truncated_eager), jax.jit(sample_eager)
SAMPLED = SamplingConfig(temperature=1.0, max_new_tokens=12)
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


def prompts(n):
    rng = np.random.default_rng(0)  # the same prompts on every call
    return [
        engine_lib.Request(f"p{i}", rng.integers(3, CONFIG.vocab_size, size=4 + i % 5).tolist())
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def params():
    return jax.jit(models.init_params, static_argnums=0)(CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def engine(params):
    return engine_lib.Engine(
        CONFIG, params, sampling=SAMPLED, max_slots=SLOTS, max_cache_len=CACHE, steps_per_sync=SYNC
    )


@pytest.fixture(scope="module")
def sampled_groups(engine):
    return engine.generate_groups(prompts(5), n_samples=3, rng=jax.random.key(1))


@jax.jit
def _learner(params, tokens_BxT):
    out = models.forward(CONFIG, params, tokens_BxT)
    return out.logits, out.routed_experts


@jax.jit
def _cached(params, tokens_BxT, positions_BxT, cache, cache_mask_BxS):
    return models.forward(
        CONFIG,
        params,
        tokens_BxT,
        positions_BxT=positions_BxT,
        cache=cache,
        cache_mask_BxS=cache_mask_BxS,
    ).logits


def full_forward(params, prompt, response):
    """Learner logits [T, V] and routed experts [T, M, k] of prompt + response (one compiled
    shape: the sequence is padded to 32, which leaves earlier positions unchanged)."""
    seq = np.concatenate([prompt, response])
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, : len(seq)] = seq
    logits, experts = _learner(params, jnp.asarray(tokens))
    return np.asarray(logits[0, : len(seq)]), np.asarray(experts[0, : len(seq)])


def test_greedy_equals_teacher_forced_argmax(engine, params):
    groups = engine.generate_groups(prompts(3), n_samples=2, sampling=GREEDY)
    for g in groups:
        assert np.array_equal(g.responses[0].tokens, g.responses[1].tokens)  # greedy: no RNG
        r = g.responses[0]
        assert len(r.tokens) == 12 and r.finish_reason == "length"
        logits, _ = full_forward(params, g.prompt_tokens, r.tokens)
        p = len(g.prompt_tokens)
        # Position p-1+t predicts response token t.
        np.testing.assert_array_equal(np.argmax(logits[p - 1 : -1], axis=-1), r.tokens)
        # Greedy records the model's log-softmax of the chosen token.
        logp = jax.nn.log_softmax(logits[p - 1 : -1], axis=-1)
        np.testing.assert_allclose(logp[np.arange(12), r.tokens], r.logprobs, atol=1e-5)


def test_stop_token_ends_a_response(engine):
    req = prompts(1)
    first = engine.generate_groups(req, sampling=GREEDY)[0].responses[0].tokens
    stop = int(first[2])
    n = int(np.flatnonzero(first == stop)[0]) + 1  # the stop token is the last one kept
    stopped = engine.generate_groups(
        req, sampling=SamplingConfig(temperature=0.0, max_new_tokens=12, stop_tokens=(stop,))
    )[0].responses[0]
    np.testing.assert_array_equal(stopped.tokens, first[:n])
    assert stopped.finish_reason == "stop"


def test_cached_decode_logits_equal_recomputed(engine, params):
    reqs = prompts(3)
    state = engine.init_decode_state()
    for slot, r in zip([2, 0, 3], reqs, strict=True):  # other rows hold other sequences
        prefix = engine.prefill(engine.params, r.tokens)
        state = engine.insert(prefix, state, slot, jax.random.key(slot))
    for _ in range(2):
        state, _ = engine.generate(engine.params, state)
    pos = np.asarray(state.pos_B)
    last = np.asarray(state.tokens_BxS)[np.arange(SLOTS), pos]
    cached = _cached(
        params,
        jnp.asarray(last)[:, None],
        jnp.asarray(pos)[:, None],
        state.cache,
        state.cache_mask_BxS,
    )
    for slot in (2, 0, 3):
        seq = np.asarray(state.tokens_BxS)[slot, : pos[slot] + 1]
        full, _ = full_forward(params, seq[:1], seq[1:])
        np.testing.assert_allclose(cached[slot, 0], full[-1], atol=1e-5, rtol=1e-5)


def test_batched_prefill_and_insert_equal_one_prompt_at_a_time(engine):
    """`prefill_many` rows match single-prompt prefills; one `insert_many` call puts each row in
    its slot exactly as one call per slot does, and its padding entries write nothing."""
    reqs = [r for r in prompts(6) if engine.prefill_len(len(r.tokens)) == 16][:3]
    assert len(reqs) == 3
    block = engine.prefill_many(engine.params, [r.tokens for r in reqs], rows=4)
    for row, r in enumerate(reqs):
        single = engine.prefill(engine.params, r.tokens)
        np.testing.assert_allclose(block.logits_NxV[row], single.logits_NxV[0], atol=1e-5)
        np.testing.assert_array_equal(block.experts_NxPxMxk[row], single.experts_NxPxMxk[0])
    sp = engine.slot_sampling(SAMPLED)
    entries = [(2, 0, jax.random.key(7), sp), (0, 2, jax.random.key(8), sp),
               (3, 1, jax.random.key(9), sp)]
    together = engine.insert_many(block, engine.init_decode_state(), entries, pad_to=SLOTS)
    apart = engine.init_decode_state()
    for e in entries:
        apart = engine.insert_many(block, apart, [e], pad_to=SLOTS)
    for a, b in zip(jax.tree.leaves(together), jax.tree.leaves(apart), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    phase = np.asarray(together.phase_B)
    assert phase[1] == FREE and (phase[[0, 2, 3]] != FREE).all()
    assert np.asarray(together.prompt_len_B).tolist() == [len(reqs[2].tokens), 0,
                                                          len(reqs[0].tokens), len(reqs[1].tokens)]
    with pytest.raises(ValueError, match="one padded length"):
        engine.prefill_many(engine.params, [[1] * 3, [1] * 20], rows=4)
    with pytest.raises(ValueError, match="takes 1..1 entries, got 3"):
        engine.insert_many(block, apart, entries, pad_to=1)


def test_fp32_logprobs_and_experts_equal_the_learner(sampled_groups, params):
    assert [g.prompt_id for g in sampled_groups] == [f"p{i}" for i in range(5)]
    for g in sampled_groups:
        assert len(g.responses) == 3
        for r in g.responses:
            p, n = len(g.prompt_tokens), len(r.tokens)
            assert r.routed_experts.shape == (p + n, CONFIG.n_moe_layers, CONFIG.top_k)
            _, experts = full_forward(params, g.prompt_tokens, r.tokens)
            # Every fed token (all but the last sampled one) carries the learner's top-k.
            np.testing.assert_array_equal(r.routed_experts[:-1], experts[:-1])
            assert np.all(r.routed_experts[-1] == -1)
    metrics = mismatch.measure_mismatch(CONFIG, params, sampled_groups, replay=False)
    assert metrics["mismatch/tokens"] == 5 * 3 * 12
    assert metrics["mismatch/logp_abs_max"] < 1e-5
    assert metrics["moe/routing_flip_rate"] == 0.0


def test_samples_do_not_depend_on_slots_or_admission(engine, sampled_groups, params):
    predictor = scheduling.LengthPredictor()
    for i in range(5):
        predictor.observe(f"p{i}", [10 - i])  # reverses the admission order
    again = engine.generate_groups(
        prompts(5),
        n_samples=3,
        rng=jax.random.key(1),
        admission="longest_first",
        predictor=predictor,
    )
    for a, b in zip(sampled_groups, again, strict=True):
        for ra, rb in zip(a.responses, b.responses, strict=True):
            np.testing.assert_array_equal(ra.tokens, rb.tokens)
            np.testing.assert_array_equal(ra.logprobs, rb.logprobs)
    # Nor on the engine's shape: four times the slots (all 15 samples in one wave) and twice the
    # decode steps per host sync (slots finish mid-call) draw the same tokens.
    wider = engine_lib.Engine(CONFIG, params, sampling=SAMPLED, max_slots=4 * SLOTS,
                              max_cache_len=CACHE, steps_per_sync=2 * SYNC)
    wide = wider.generate_groups(prompts(5), n_samples=3, rng=jax.random.key(1))
    for a, b in zip(sampled_groups, wide, strict=True):
        for ra, rb in zip(a.responses, b.responses, strict=True):
            np.testing.assert_array_equal(ra.tokens, rb.tokens)
            np.testing.assert_allclose(ra.logprobs, rb.logprobs, atol=1e-5)
    other = engine.generate_groups(prompts(5), n_samples=3, rng=jax.random.key(2))
    assert not all(
        np.array_equal(a.responses[0].tokens, b.responses[0].tokens)
        for a, b in zip(sampled_groups, other, strict=True)
    )


def test_shards_sample_what_one_engine_samples(sampled_groups, params):
    # Two shards of SLOTS slots, each driven by its own thread: the requests split by token
    # budget (3 x 12 each: p0, p2, p4 to one shard, p1, p3 to the other), each keeps its RNG
    # stream, so every sample is the one-engine sample; groups in request order, their index
    # the request's, on_group once per group.
    sharded = engine_lib.Engine(CONFIG, params, sampling=SAMPLED, max_slots=2 * SLOTS,
                                max_cache_len=CACHE, steps_per_sync=SYNC, shards=2)
    assert batching.shard_requests(prompts(5), 2, 3, SAMPLED) == [[0, 2, 4], [1, 3]]
    seen = []
    groups = sharded.generate_groups(prompts(5), n_samples=3, rng=jax.random.key(1),
                                     on_group=lambda g: seen.append(g.request_index))
    assert [g.request_index for g in groups] == list(range(5)) and sorted(seen) == list(range(5))
    assert [g.prompt_id for g in groups] == [f"p{i}" for i in range(5)]
    for a, b in zip(sampled_groups, groups, strict=True):
        for ra, rb in zip(a.responses, b.responses, strict=True):
            np.testing.assert_array_equal(ra.tokens, rb.tokens)
            np.testing.assert_allclose(ra.logprobs, rb.logprobs, atol=1e-5)
    stats = sharded.last_stats
    assert stats["engine/generated_tokens"] == 5 * 3 * 12
    # 9 and 6 samples of 12 tokens on 4 slots each: 3 and 2 waves of 11 decode steps, 3 syncs
    # of 4 steps per wave: the longer shard runs 9 syncs, 36 steps.
    assert stats["engine/decode_steps"] == 36
    with pytest.raises(ValueError, match=r"max_slots \(6\) must be a multiple of shards \(4\)"):
        engine_lib.Engine(CONFIG, params, max_slots=6, shards=4)


def test_auto_shards_one_per_core_up_to_two_dividing_the_slots():
    """shards=0 (the default config's): on this CPU backend min(2, cores), lowered to a
    divisor of the slots; the engine runs that many."""
    two = 2 if (os.cpu_count() or 1) >= 2 else 1
    assert jax.default_backend() == "cpu"
    assert [engine_lib.auto_shards(n) for n in (64, 6, 3, 1)] == [two, two, 1, 1]
    assert engine_lib.Engine(CONFIG, max_slots=8, shards=0).shards == two
    with pytest.raises(ValueError, match=r"shards \(-1\) >= 0"):
        engine_lib.Engine(CONFIG, max_slots=8, shards=-1)


def test_a_failing_shard_stops_the_other(params):
    sharded = engine_lib.Engine(CONFIG, params, sampling=SAMPLED, max_slots=2 * SLOTS,
                                max_cache_len=CACHE, steps_per_sync=SYNC, shards=2)

    failing, syncs = threading.Event(), threading.local()

    def on_group(g):
        if g.request_index == 0:
            failing.set()
            raise RuntimeError("scoring failed")

    def stop() -> bool:  # polled by each shard at each sync; never asks to stop
        # A shard's syncs after its third wait until request 0 has failed: whichever thread
        # runs first (the other may still be compiling), the failure lands while shard 0's
        # samples are in flight.
        syncs.n = getattr(syncs, "n", 0) + 1
        if syncs.n > 3:
            failing.wait(timeout=60)
        return False

    # Request 0 (12 tokens, shard 1: the longer budget goes first, to shard 0) fails at shard
    # 1's third sync, long before request 1's 60-token samples (15 syncs) would be done:
    # shard 0 stops at its next sync instead of finishing them.
    requests = [engine_lib.Request("short", [5, 6], max_new_tokens=12),
                engine_lib.Request("long", [7, 8], max_new_tokens=60)]
    with pytest.raises(RuntimeError, match="scoring failed"):
        sharded.generate_groups(requests, n_samples=4, rng=jax.random.key(0), on_group=on_group,
                                stop=stop)
    long_shard = sharded._shards()[0]
    assert long_shard.last_stats["engine/abandoned_samples"] == 4
    assert long_shard.last_stats["engine/generated_tokens"] == 0


def test_continuous_batching_refills_slots(engine):
    # One 33-token request and seven 5-token ones, 4 slots, 4 steps per sync. A response of n
    # tokens draws its first at insert and needs n-1 decode steps: 32 (8 syncs) and 4 (1 sync).
    long = engine_lib.Request("long", [5, 6, 7], max_new_tokens=33)
    short = [engine_lib.Request(f"s{i}", [8, 9], max_new_tokens=5) for i in range(7)]
    completed = []
    groups = engine.generate_groups(
        [long] + short, on_group=lambda g: completed.append(g.prompt_id)
    )
    assert [len(g.responses[0].tokens) for g in groups] == [33] + [5] * 7
    # The long one holds slot 0 for 8 syncs while the other 3 slots run the 7 short ones in 3:
    # 8 syncs = 32 steps (a static batch would wait: 8 + 1 syncs).
    assert engine.last_stats["engine/decode_steps"] == 32
    # Busy slot-steps 32 + 7 * 4 = 60 of 32 * 4 = 128.
    assert engine.last_stats["engine/idle_slot_frac"] == pytest.approx(1 - 60 / 128)
    assert completed[-1] == "long" and [g.prompt_id for g in groups][0] == "long"
    # FIFO with the long request last: it starts in sync 2 and ends after sync 9 = 36 steps;
    # longest-first admission restores 32.
    order = short + [long]
    engine.generate_groups(order)
    assert engine.last_stats["engine/decode_steps"] == 36
    predictor = scheduling.LengthPredictor()
    predictor.observe("long", [33])
    predictor.observe("s0", [5])
    engine.generate_groups(order, admission="longest_first", predictor=predictor)
    assert engine.last_stats["engine/decode_steps"] == 32


def scale_experts(params, factor):
    """Expert weights x factor: at init (std 0.02) an expert's output is ~1e-4 of the residual
    stream and a routing flip moves no logit; scaled, experts matter as in a trained model."""
    scaled = {}
    for name, layer in params.items():
        if "moe" in layer:
            moe = dict(layer["moe"])
            for w in ("wi_gate", "wi_up", "wo"):
                moe[w] = moe[w] * factor
            layer = {**layer, "moe": moe}
        scaled[name] = layer
    return scaled


@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
def test_fp8_with_replay_reduces_the_gap(params, precision):
    """Per-channel and 128x128 block scales (on the tiny model one tile per kernel and expert:
    coarser than per channel)."""
    learner = scale_experts(params, 4.0)
    fp8 = engine_lib.Engine(
        CONFIG,
        learner,
        sampling=SAMPLED,
        max_slots=SLOTS,
        max_cache_len=CACHE,
        steps_per_sync=SYNC,
        precision=precision,
    )
    assert fp8.sampler_name == f"jax-{precision}"
    groups = fp8.generate_groups(prompts(8), n_samples=2, rng=jax.random.key(3))
    plain = mismatch.measure_mismatch(CONFIG, learner, groups, replay=False)
    replay = mismatch.measure_mismatch(CONFIG, learner, groups, replay=True)
    factor = plain["mismatch/logp_abs_mean"] / replay["mismatch/logp_abs_mean"]
    at_flips = plain["mismatch/logp_abs_mean_at_flips"] / replay["mismatch/logp_abs_mean_at_flips"]
    print(
        f"\n{precision} engine vs fp32 learner: mean |dlogp| {plain['mismatch/logp_abs_mean']:.2e} "
        f"without replay, {replay['mismatch/logp_abs_mean']:.2e} with ({factor:.2f}x); at the "
        f"{plain['mismatch/tokens_at_flips']:.0f} tokens after a flip {at_flips:.1f}x; "
        f"flip rate {plain['moe/routing_flip_rate']:.3f}"
    )
    assert plain["moe/routing_flip_rate"] > 0.01  # FP8 noise flips some routing decisions
    assert plain["mismatch/logp_abs_mean"] > 1e-3  # far above fp32 numerics (1e-6)
    # Replay removes the flips' share of the gap; FP8 weight noise at every token remains.
    assert factor > 1.2
    assert at_flips > 3.0


@pytest.mark.parametrize("precision", ["fp8", "fp8_block"])
def test_fp8_dequantised_once_samples_what_fp8_storage_samples(params, precision):
    """Dequantising the E4M3 weights once per load (the default) must not change a sample:
    same tokens, log-probs and routing as dequantising them in every forward."""
    learner = scale_experts(params, 4.0)
    kw = dict(sampling=SAMPLED, max_slots=SLOTS, max_cache_len=CACHE, steps_per_sync=SYNC,
              precision=precision)
    once = engine_lib.Engine(CONFIG, learner, **kw)
    stored = engine_lib.Engine(CONFIG, learner, fp8_storage=True, **kw)
    kernel = once.params["layers_0"]["moe"]["wi_gate"]
    assert kernel.dtype == jnp.float32  # dequantised: every value is an E4M3 value x its scale
    np.testing.assert_array_equal(
        kernel, models.quant.maybe_dequant(stored.params["layers_0"]["moe"]["wi_gate"]))
    assert stored.params["layers_0"]["moe"]["wi_gate"]["qvalue"].dtype == jnp.float8_e4m3fn
    a = once.generate_groups(prompts(6), n_samples=2, rng=jax.random.key(5))
    b = stored.generate_groups(prompts(6), n_samples=2, rng=jax.random.key(5))
    for ga, gb in zip(a, b, strict=True):
        for ra, rb in zip(ga.responses, gb.responses, strict=True):
            np.testing.assert_array_equal(ra.tokens, rb.tokens)
            np.testing.assert_array_equal(ra.logprobs, rb.logprobs)
            np.testing.assert_array_equal(ra.routed_experts, rb.routed_experts)


def test_host_then_learner_weights_share_the_compiled_decode(params):
    """Weights loaded from host arrays, then a learner's committed arrays (as after an update):
    the second load compiles nothing new."""
    host = jax.tree.map(np.asarray, params)
    engine = engine_lib.Engine(CONFIG, host, sampling=SAMPLED, max_slots=SLOTS,
                               max_cache_len=CACHE, steps_per_sync=SYNC)
    engine.generate_groups(prompts(2), n_samples=2, rng=jax.random.key(0))
    sizes = [f._cache_size() for f in (decode.prefill_jit, decode.insert_jit,
                                       decode.generate_jit)]
    engine.load_params(jax.device_put(host, jax.devices()[0]))  # committed, as a learner's
    engine.generate_groups(prompts(2), n_samples=2, rng=jax.random.key(0))
    assert [f._cache_size() for f in (decode.prefill_jit, decode.insert_jit,
                                      decode.generate_jit)] == sizes


def test_truncation_by_hand():
    # probs .4 .3 .2 .1
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]] * 4))
    x = truncated_logits(
        logits, jnp.ones(4), jnp.array([0, 2, 0, 0]), jnp.array([1.0, 1.0, 0.6, 0.75])
    )
    finite = np.isfinite(np.asarray(x))
    # Row 0 keeps all; top_k 2 keeps 2; top_p .6: mass before = 0, .4, .7 -> keeps 2; .75 keeps 3.
    assert finite.sum(axis=1).tolist() == [4, 2, 2, 3]
    np.testing.assert_allclose(jax.nn.log_softmax(x[1])[0], np.log(0.4 / 0.7), rtol=1e-6)
    # Temperature 0.5 squares the probabilities: .16 / (.16 + .09 + .04 + .01) = .16 / .3.
    x = truncated_logits(logits[:1], jnp.array([0.5]), jnp.array([0]), jnp.array([1.0]))
    np.testing.assert_allclose(jax.nn.log_softmax(x[0])[0], np.log(0.16 / 0.3), rtol=1e-5)


def test_untruncated_rows_keep_every_logit():
    """No row truncating (the sort skipped) or one row truncating (the sort taken for the
    batch): the untruncated rows are logits / temperature, bit for bit, either way."""
    logits = jax.random.normal(jax.random.key(1), (3, 50))
    temps = jnp.array([1.0, 0.7, 1.0])
    want = np.asarray(logits / temps[:, None])
    x = truncated_logits(logits, temps, jnp.zeros(3, int), jnp.ones(3))
    np.testing.assert_array_equal(x, want)
    x = truncated_logits(logits, temps, jnp.array([0, 0, 5]), jnp.ones(3))
    np.testing.assert_array_equal(x[:2], want[:2])
    assert np.isfinite(np.asarray(x[2])).sum() == 5


def test_sample_frequencies_and_greedy():
    n = 4000
    logits = jnp.broadcast_to(jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1])), (n, 4))
    keys = jax.random.split(jax.random.key(0), n)
    tokens, logp = sample(logits, keys, jnp.ones(n), jnp.full(n, 2), jnp.ones(n))
    counts = np.bincount(np.asarray(tokens), minlength=4)
    assert counts[2] == counts[3] == 0
    assert counts[0] / n == pytest.approx(4 / 7, abs=0.03)  # 3 sigma ~ 0.023
    np.testing.assert_allclose(logp[tokens == 1], np.log(3 / 7), rtol=1e-5)
    tokens, logp = sample(logits[:2], keys[:2], jnp.zeros(2), jnp.zeros(2, int), jnp.ones(2))
    assert tokens.tolist() == [0, 0]
    np.testing.assert_allclose(logp, np.log(0.4), rtol=1e-6)


def test_bad_requests_are_named(engine):
    with pytest.raises(ValueError, match=r"\(prompt 'x'\) has 60 prompt tokens; need 1..52"):
        engine.generate_groups([engine_lib.Request("x", [3] * 60)])  # 60 > 64 - 12
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate_groups([engine_lib.Request("x", [3, 999])])
    with pytest.raises(ValueError, match="LengthPredictor"):
        engine.generate_groups(prompts(1), admission="longest_first")
    with pytest.raises(ValueError, match="precision 'int4' unknown"):
        engine_lib.Engine(CONFIG, precision="int4")
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate_groups(prompts(1), sampling=SamplingConfig(max_new_tokens=64))


def test_engine_params_per_precision(params):
    p32, c32 = engine_lib.engine_params(params, CONFIG.replace(dispatch="capacity"), "fp32")
    # dropping tokens would couple a sample to its neighbours; the looped layout is exact
    assert c32.dispatch == "dropless_loop"
    pbf, cbf = engine_lib.engine_params(params, CONFIG, "bf16")
    assert (cbf.dtype, cbf.param_dtype) == ("bfloat16", "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(pbf)} == {jnp.dtype(jnp.bfloat16)}
    p8, c8 = engine_lib.engine_params(params, CONFIG, "fp8")
    assert c8.dtype == "float32"
    moe = p8["layers_0"]["moe"]
    assert moe["wi_gate"]["qvalue"].dtype == jnp.float8_e4m3fn  # experts in FP8
    assert moe["router"]["kernel"].dtype == jnp.float32  # the router stays fp32
    assert p8["layers_0"]["attn"]["q_proj"]["kernel"]["qvalue"].dtype == jnp.float8_e4m3fn
    assert p8["lm_head"]["kernel"].dtype == jnp.float32
    assert moe["wi_gate"]["scale"].shape == (8, 1, 32)  # per expert and output channel
    pb, _ = engine_lib.engine_params(params, CONFIG, "fp8_block")
    gate = pb["layers_0"]["moe"]["wi_gate"]
    assert gate["qvalue"].dtype == jnp.float8_e4m3fn
    assert gate["scale"].shape == (8, 1, 1)  # [64, 32] per expert: one 128x128 tile
    np.testing.assert_array_equal(  # scale = amax / 448 of the tile
        gate["scale"][:, 0, 0], jnp.max(jnp.abs(params["layers_0"]["moe"]["wi_gate"]),
                                        axis=(1, 2)) / 448)
    assert pb["layers_0"]["moe"]["router"]["kernel"].dtype == jnp.float32


def test_batched_request_keys_equal_one_at_a_time():
    """An admission round draws its keys in one call: each is request_key(rng, seed, sample)
    bit for bit (the samples depend on nothing else)."""
    from espo_jax.rollout.batching import request_key, request_key_data

    rng = jax.random.key(7)
    seeds, samples = [0, 3, 3, 11, 2**20, 2**32 - 1], [0, 0, 5, 1, 63, 2]
    batched = request_key_data(rng, seeds, samples, pad_to=8)
    assert batched.shape[0] == len(seeds)
    for row, s, g in zip(batched, seeds, samples, strict=True):
        np.testing.assert_array_equal(row, jax.random.key_data(request_key(rng, s, g)))
