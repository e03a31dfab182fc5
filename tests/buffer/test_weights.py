"""Published-weights directory: atomic versions, latest, load, retention, HF export."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from espo_jax import models
from espo_jax.buffer import weights
from espo_jax.models import hf_io
from espo_jax.models.config import ModelConfig

CONFIG = models.get_preset("tiny")


@pytest.fixture(scope="module")
def params():
    return jax.device_get(jax.jit(models.init_params, static_argnums=0)(CONFIG, jax.random.key(0)))


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def test_publish_load_round_trip(tmp_path, params):
    assert weights.latest(tmp_path) is None
    path = weights.publish(tmp_path, 1, CONFIG, params)
    assert path.name == "v00000001"
    assert sorted(p.name for p in path.iterdir()) == [
        "COMMITTED",
        "config.json",
        "meta.json",
        "params.msgpack",
    ]
    assert weights.latest(tmp_path) == (1, path)
    config, loaded = weights.load(path)
    assert ModelConfig.from_dict(config) == CONFIG
    assert_same_tree(loaded, params)  # bitwise
    with pytest.raises(FileExistsError, match="version 1 already published"):
        weights.publish(tmp_path, 1, CONFIG, params)


def test_bf16_params_round_trip(tmp_path, params):
    bf16 = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params)
    _, loaded = weights.load(weights.publish(tmp_path, 0, CONFIG, bf16))
    assert_same_tree(loaded, jax.device_get(bf16))


def test_uncommitted_and_tmp_versions_are_invisible(tmp_path, params):
    weights.publish(tmp_path, 3, CONFIG, params)
    (tmp_path / "v00000009").mkdir()  # a bucket copy in progress: no COMMITTED yet
    (tmp_path / ".tmp-v00000010-123-abc").mkdir()  # a publisher that is still writing
    assert weights.latest(tmp_path)[0] == 3
    with pytest.raises(FileNotFoundError, match="not a committed weights version"):
        weights.load(tmp_path / "v00000009")
    # A stale temporary directory (its publisher died) is removed by the next publish.
    os.utime(tmp_path / ".tmp-v00000010-123-abc", (0, 0))
    weights.publish(tmp_path, 4, CONFIG, params)
    assert not (tmp_path / ".tmp-v00000010-123-abc").exists()


def test_retention_keeps_the_newest(tmp_path, params):
    for v in (1, 2, 5, 7):
        weights.publish(tmp_path, v, CONFIG, params, keep=2)
    assert [v for v, _ in weights.versions(tmp_path)] == [5, 7]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        weights.publish(tmp_path, 8, CONFIG, params, keep=0)
    with pytest.raises(ValueError, match="version must be an int"):
        weights.publish(tmp_path, -1, CONFIG, params)


def test_foreign_config_is_a_clear_error(tmp_path, params):
    path = weights.publish(tmp_path, 1, CONFIG, params)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "n_dragons": 3}))
    with pytest.raises(ValueError, match="does not match this ModelConfig.*n_dragons"):
        ModelConfig.from_dict(weights.load(path)[0], "config.json")


def test_hf_export_for_vllm_workers(tmp_path, params):
    path = weights.publish(tmp_path, 2, CONFIG, params,
                           hf_export=hf_io.exporter(CONFIG, params))
    config, loaded = hf_io.from_pretrained(os.fspath(path / "hf"))
    assert config.n_experts == CONFIG.n_experts and config.n_layers == CONFIG.n_layers
    assert_same_tree(loaded, params)


def test_params_file_is_flax_msgpack(params):
    # The buffer writes parameters without JAX; the file stays what flax.serialization reads
    # and writes (bfloat16 leaves included), so tools on either side interoperate.
    from flax import serialization

    tree = {**params, "extra": {"bf16": np.arange(6, dtype=np.float32).reshape(2, 3).astype(
        jax.numpy.bfloat16), "step": np.int32(7).reshape(())}}
    assert_same_tree(serialization.msgpack_restore(weights.pack_params(tree)), tree)
    assert_same_tree(weights.unpack_params(serialization.msgpack_serialize(tree)), tree)


def test_buffer_package_imports_no_jax():
    # Rollout workers and inspection tools import the buffer contract; it must not pull JAX in.
    code = ("import sys, espo_jax.buffer, espo_jax.buffer.weights, espo_jax.buffer.inspect; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"
