"""The JAX engine through JetStream's Engine API; skipped when google-jetstream is absent.

JetStream is not a project dependency (README "Scaling out": a --no-deps install on top of the
project's TensorFlow). The loop below is JetStream's generate/detokenize loop in miniature: it
reads results with JetStream's own `token_utils.process_result_tokens`.
"""

import jax
import numpy as np
import pytest

pytest.importorskip("jetstream.engine.engine_api",
                    reason="google-jetstream not installed (optional, README 'Scaling out')")

from jetstream.engine import engine_api, token_utils  # noqa: E402

from espo_jax import models  # noqa: E402
from espo_jax.rollout.engine import Engine, Request  # noqa: E402
from espo_jax.rollout.jetstream_adapter import JetStreamEngine  # noqa: E402
from espo_jax.rollout.sampling import SamplingConfig  # noqa: E402
from espo_jax.tokenizer import CharTokenizer  # noqa: E402

MAX_NEW, STOP = 6, 2


@pytest.fixture(scope="module")
def engine():
    config = models.get_preset("tiny")
    params = models.init_params(config, jax.random.key(0))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, stop_tokens=(STOP,))
    return Engine(config, params, sampling=sampling, max_slots=2, max_cache_len=32,
                  steps_per_sync=2)


def drive(adapter, prompts):
    """JetStream-style: prefill, insert into free slots, generate, detokenize per slot."""
    tok = adapter.build_tokenizer(adapter.get_tokenizer())
    params = adapter.load_params()
    state = adapter.init_decode_state()
    queue = list(enumerate(prompts))
    live, out, records = {}, {}, {}
    while queue or live:
        for slot in range(adapter.max_concurrent_decodes):
            if slot not in live and queue:
                i, text = queue.pop(0)
                padded, n = tok.encode(text, is_bos=True)
                prefix = adapter.prefill(params=params, padded_tokens=padded, true_length=n)
                state = adapter.insert(prefix, state, slot)
                live[slot], out[i] = (i, np.zeros(1, bool)), []
        state, result = adapter.generate(params, state)
        result = result.convert_to_numpy()
        for slot, (i, complete) in list(live.items()):
            samples, complete = token_utils.process_result_tokens(
                tokenizer=tok, slot=slot, slot_max_length=MAX_NEW, result_tokens=result,
                complete=complete)
            out[i] += samples[0].token_ids
            live[slot] = (i, complete)
            if complete.all():
                records[i] = adapter.generation(state, slot)
                del live[slot]
    return out, records


def test_is_a_jetstream_engine(engine):
    adapter = JetStreamEngine(engine, CharTokenizer())  # abstract methods all implemented
    assert isinstance(adapter, engine_api.Engine)
    assert (adapter.max_concurrent_decodes, adapter.samples_per_slot) == (2, 1)
    assert adapter.max_prefill_length == 32 - MAX_NEW
    with pytest.raises(ValueError, match="existing_prefix"):
        adapter.prefill(params=adapter.load_params(), existing_prefix=object(),
                        padded_tokens=np.zeros(16, np.int32), true_length=3)


def test_same_samples_as_generate_groups(engine):
    prompts = ["1+2=", "7*8-3=", "99", "a"]
    rng = jax.random.key(5)
    tok = CharTokenizer()
    requests = [Request(i, tok.encode(p, add_bos=True), seed=i) for i, p in enumerate(prompts)]
    # Make the stop path certain: stop at the token prompt 0 samples third (a first run without
    # stop tokens finds it; sampling never depends on the stop tokens before they stop).
    free = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, stop_tokens=())
    third = int(engine.generate_groups(requests[:1], rng=rng, sampling=free)[0]
                .responses[0].tokens[2])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW, stop_tokens=(third,))
    adapter = JetStreamEngine(engine, tok, rng=rng, sampling=sampling)
    out, records = drive(adapter, prompts)
    # The n-th insert samples as request seed n, sample 0; inserts follow the prompt order here.
    reference = engine.generate_groups(requests, n_samples=1, rng=rng, sampling=sampling)
    assert reference[0].responses[0].finish_reason == "stop"
    assert len(reference[0].responses[0].tokens) <= 3
    for i, group in enumerate(reference):
        ref = group.responses[0]
        expected = ref.tokens.tolist()
        if ref.finish_reason == "stop":  # JetStream does not return the stop token itself
            expected = expected[:-1]
        assert out[i] == expected, (i, out[i], ref.tokens)
        np.testing.assert_array_equal(records[i].tokens, ref.tokens)
        np.testing.assert_allclose(records[i].logprobs, ref.logprobs, rtol=1e-6)
        np.testing.assert_array_equal(records[i].routed_experts, ref.routed_experts)
        assert records[i].finish_reason == ref.finish_reason
        assert 1 <= len(ref.tokens) <= MAX_NEW
