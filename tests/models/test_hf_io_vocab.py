"""`hf_io.from_pretrained` compares the vocabulary tensors' shapes (from the safetensors header)
with config.json before it reads any tensor: a checkpoint whose LM head, the last tensor in
the model's order, has another vocabulary is refused without reading the layers before it."""

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from espo_jax.models import get_preset, hf_io, init_params


def test_a_vocabulary_mismatch_is_found_before_any_tensor_is_read(tmp_path, monkeypatch):
    tiny = get_preset("tiny")  # untied: embed first, lm_head last
    assert not tiny.tie_embeddings
    hf_io.save_pretrained(tiny, init_params(tiny, jax.random.key(0)), str(tmp_path))
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = np.zeros((tiny.vocab_size + 3, tiny.d_model), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["vocab_size"] == tiny.vocab_size
    read = []
    get = hf_io._TensorReader.get
    monkeypatch.setattr(hf_io._TensorReader, "get",
                        lambda self, name: read.append(name) or get(self, name))
    with pytest.raises(ValueError) as raised:
        hf_io.from_pretrained(str(tmp_path))
    assert str(raised.value) == (
        f"checkpoint {tmp_path}: lm_head.weight has {tiny.vocab_size + 3} vocabulary rows but "
        f"config.json's vocab_size is {tiny.vocab_size}")
    assert read == []
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:tiny.vocab_size]
    save_file(tensors, path, metadata={"format": "pt"})
    config, _ = hf_io.from_pretrained(str(tmp_path))  # the right shape reads as before
    assert config.vocab_size == tiny.vocab_size and len(read) == len(tensors)
