"""Warm-start batches (alignment by hand) and held-out evaluation (per-level accuracy, pass@k)
with the real embedded engine on a tiny model."""

import jax
import numpy as np
import pytest

from espo_jax import sharding
from espo_jax.models.presets import get_preset
from espo_jax.rollout.engine import Engine
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.tokenizer import CharTokenizer
from espo_jax.train.evaluate import evaluate
from espo_jax.train.warmstart import sft_batch, warm_seq_len

TOK = CharTokenizer()


def test_sft_batch_alignment_by_hand():
    prompts = [
        {"prompt_id": "a", "tokens": TOK.encode("1+2=", add_bos=True), "solution": "3#3"},
        {"prompt_id": "b", "tokens": TOK.encode("9-9=", add_bos=True), "solution": "0#0"},
    ]
    batch = sft_batch(prompts, np.array([1, 0, 0]), TOK, seq_len=10)
    # Row 0 is prompt "b": bos 9 - 9 = | 0 # 0 | eos: 9 tokens -> 8 inputs; the targets from
    # position 4 on (after "=") are the solution and eos: 4 masked targets.
    full = TOK.encode("9-9=", add_bos=True) + TOK.encode("0#0") + [TOK.eos_id]
    np.testing.assert_array_equal(batch["tokens"][0], full[:-1] + [0, 0])
    np.testing.assert_array_equal(batch["targets"][0], full[1:] + [0, 0])
    np.testing.assert_array_equal(batch["mask"][0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0])
    assert TOK.decode(batch["targets"][0][batch["mask"][0] > 0], stop_at_eos=False) == "0#0"
    np.testing.assert_array_equal(batch["tokens"][1], batch["tokens"][2])  # prompt "a" twice
    np.testing.assert_array_equal(batch["positions"][2], np.arange(10))
    with pytest.raises(ValueError, match="warm-start example 'a' has 9 tokens > seq_len \\+ 1 = 8"):
        sft_batch(prompts, np.array([0]), TOK, seq_len=7)


def test_warm_seq_len_fits_the_longest_example():
    prompts = [{"tokens": TOK.encode("1+2=", add_bos=True), "solution": "3#3"},  # 5 + 3 = 8
               {"tokens": TOK.encode("11+2=", add_bos=True), "solution": "13#13"}]  # 6 + 5
    # 11 inputs (bos + prompt + solution; eos is only a target) -> 16, the next multiple of 8
    assert warm_seq_len(prompts, TOK, cap=63) == 16
    assert warm_seq_len(prompts[:1], TOK, cap=63) == 8
    assert warm_seq_len(prompts, TOK, cap=12) == 12  # never beyond the RL sequence length
    batch = sft_batch(prompts, np.array([0, 1]), TOK, seq_len=warm_seq_len(prompts, TOK, 63))
    assert batch["mask"][1].sum() == 6  # "13#13" + eos all fit


@pytest.fixture(scope="module")
def engine():
    model_config = get_preset("tiny")
    mesh = sharding.make_mesh(_Mesh(), devices=jax.devices()[:1])
    params = sharding.init_sharded(model_config, mesh, rng=jax.random.key(1))
    return Engine(model_config, jax.device_get(params), precision="fp32", max_slots=4,
                  max_cache_len=16,
                  sampling=SamplingConfig(max_new_tokens=8, stop_tokens=(TOK.eos_id,)))


class _Mesh:
    data = fsdp = expert = tensor = 1


def test_evaluate_per_level_accuracy_and_pass_at_k(engine):
    prompts = [{"prompt_id": f"p{i}", "tokens": TOK.encode(f"{i}+1=", add_bos=True),
                "answer": str(i + 1), "level": 1 + i % 2} for i in range(5)]
    seen = []

    def outcome(prompt, text):
        seen.append((text, prompt["answer"]))
        return prompt["answer"] in ("1", "3")  # "right" exactly for prompts 0 and 2 (level 1)

    decode = lambda ids: TOK.decode(ids, errors="replace")
    m = evaluate(engine, prompts, decode=decode, outcome=outcome, pass_k=2,
                 rng=jax.random.key(0))
    # Level 1 holds prompts 0, 2, 4 (2 of 3 right), level 2 prompts 1, 3 (none): 2 of 5 overall.
    assert m["eval/accuracy"] == pytest.approx(2 / 5)
    assert m["eval/accuracy_level1"] == pytest.approx(2 / 3)
    assert m["eval/accuracy_level2"] == 0.0
    assert m["eval/pass_at_k"] == pytest.approx(2 / 5)  # the verdict ignores the samples
    assert m["eval/pass_at_k_level1"] == pytest.approx(2 / 3)
    assert m["eval/pass_at_k_level2"] == 0.0
    # Both samples of prompts 0 and 2 are right, none of the others'.
    assert m["eval/sample_accuracy"] == pytest.approx(2 / 5)
    assert m["eval/sample_accuracy_level1"] == pytest.approx(2 / 3)
    assert 1 <= m["eval/mean_response_len"] <= 8
    # One greedy answer each, then k = 2 samples each, all scored: 5 + 5 * 2 = 15 verdicts.
    assert len(seen) == 15
    # Greedy decoding is deterministic: a second evaluation decodes the same texts.
    first = [t for t, _ in seen[:5]]
    seen.clear()
    evaluate(engine, prompts, decode=decode, outcome=outcome, pass_k=0)
    assert [t for t, _ in seen] == first
