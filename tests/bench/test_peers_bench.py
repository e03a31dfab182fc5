"""`bench peers`' workload: the same model and tokens on both sides, a GRPO step of each."""

import jax
import numpy as np
import pytest
import torch

from espo_jax.bench import peers
from espo_jax.models import forward, hf_io


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("peers_model"))
    peers.save_workload_model(path)
    return path


def test_tokenizer_one_id_per_character_and_an_end_the_model_cannot_emit():
    tok = peers.char_tokenizer()
    text = peers.prompt_texts(1)[0]
    ids = tok.encode(text)
    assert len(ids) == peers.PROMPT_LEN and max(ids) < 64
    assert tok.decode(ids) == text
    assert tok.eos_token_id == tok.pad_token_id == 64


def test_the_workload_model_is_the_issue_s_and_espo_reads_it_exactly(workload):
    from transformers import AutoModelForCausalLM

    config, params = hf_io.from_pretrained(workload)
    # embed + head 2 * 64 * 128; per layer: q/o 128 * 128, k/v 128 * 64, q/k norms 2 * 32,
    # two norms 2 * 128, router 128 * 8, experts 8 * 3 * 128 * 256; final norm 128.
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 64 + 256 + 1024 + 8 * 3 * 128 * 256
    assert config.param_count() == 2 * 64 * 128 + 4 * per_layer + 128 == 3_364_224
    tokens = np.random.default_rng(0).integers(0, 64, (2, 20))
    ours = np.asarray(forward(config, params, tokens).logits)
    model = AutoModelForCausalLM.from_pretrained(workload, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_a_grpo_step_on_each_side(workload, tmp_path):
    config, params = hf_io.from_pretrained(workload)
    tok = peers.char_tokenizer()
    texts = peers.prompt_texts(peers.PROMPTS)
    espo = peers.EspoGrpo(config, jax.tree.map(np.asarray, params),
                          [tok.encode(t) for t in texts])
    before = jax.tree.map(np.array, espo.state.params)  # copies: the step donates
    espo.step()
    # 64 responses of exactly 32 tokens (no stop token); the reward is their even-id share.
    assert 0.3 < espo.last["reward"] < 0.7
    moved = [float(np.max(np.abs(a - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(espo.state.params),
                             strict=True)]
    assert max(moved) > 0
    between = []  # the benchmark alternates: an espo_jax step after each TRL step
    seconds, info = peers.trl_grpo_seconds(workload, texts, 1, str(tmp_path / "trl"),
                                           between=lambda: between.append(1))
    assert len(seconds) == 1 and seconds[0] > 0 and info["trl_threads"] >= 1
    assert between == [1]
