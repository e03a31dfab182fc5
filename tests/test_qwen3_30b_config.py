"""The real-scale experiment `experiments/qwen3_30b_a3b.py`: it validates, and the 30B model's
parameters fit its meshes (shapes from `jax.eval_shape`: no weight is materialised)."""

import functools
import importlib.util
import math
import os

import flax.linen as nn
import jax
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from espo_jax import config_validation, mesh_rules, sharding
from espo_jax.models.flops import param_count
from espo_jax.models.transformer import init_boxed
from espo_jax.run_setup import preset_model_config

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                    "qwen3_30b_a3b.py")
# Qwen3-30B-A3B by hand (d=2048, 48 layers, 32 query / 4 kv heads of 128, 128 experts of 768,
# top 8, |V| = 151936, untied):
#   attention/layer = 2048*128*(32+2*4) + 32*128*2048 + 2*2048 (norms) + 2*128 (qk norms)
#                   = 10_485_760 + 8_388_608 + 4_096 + 256 = 18_878_720
#   MoE/layer       = 2048*128 (router) + 128*3*2048*768 = 262_144 + 603_979_776 = 604_241_920
#   embeddings      = 2*151936*2048 = 622_329_856, final norm 2048
#   total  = 48*(18_878_720 + 604_241_920) + 622_329_856 + 2048 = 30_532_122_624  (~30.5B)
#   active = 48*(18_878_720 + 262_144 + 8*3*2048*768) + 622_331_904 = 3_353_032_704 (~3.35B)
TOTAL, ACTIVE = 30_532_122_624, 3_353_032_704
# Replicated under every rule: RMSNorm scales, 48*(2048+2048+128+128) + 2048 = 210_944.
NORMS = 210_944


def load(arg=None):
    spec = importlib.util.spec_from_file_location("qwen3_30b_a3b", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


@pytest.fixture(scope="module")
def model():
    """(model config, abstract parameter shapes, logical specs) of the full config's preset."""
    config = load()
    model_config = preset_model_config(config)  # the run's architecture (hf_path's config.json)
    boxed = jax.eval_shape(functools.partial(init_boxed, model_config), jax.random.key(0))
    return model_config, nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def test_full_config_validates_with_paper_settings():
    c = load()
    config_validation.validate(c, n_devices=8, check_paths=False)
    assert (c.rollout.engine, c.rollout.precision, c.train.loop) == ("vllm", "fp8", "async")
    assert (c.model.preset, c.model.hf_path) == ("qwen3_30b_a3b", "/models/Qwen3-30B-A3B")
    assert c.tokenizer == "/models/Qwen3-30B-A3B/tokenizer.json"
    assert (c.data.name, c.loss.name, c.loss.vocab_size) == ("math_jsonl", "espo", 151936)
    assert (c.optim.lr, c.zve.n_samples, c.rollout.temperature) == (1e-6, 8, 1.0)
    assert c.rollout.prompts_per_step == 128
    assert c.rollout.max_prompt_len + c.rollout.max_new_tokens == 16384
    # 128 prompts x 8 = 1024 rows, 4 updates of 256, over fsdp=8: 32 rows per device per
    # update, one 16k sequence per device per micro-batch -> 32 micro-batches.
    assert (c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor) == (1, 8, 1, 1)
    assert c.train.micro_batches == 32
    assert c.train.num_workers == 0  # vLLM workers come from the launch script
    # 16k tokens fit only with layer remat and chunked attention (README: bench attention).
    model_config = preset_model_config(c)
    assert (model_config.remat, model_config.attention_chunk, model_config.dispatch) == (
        True, 1024, "ragged")


def test_tpu_variant_needs_its_slice():
    c = load("tpu")
    config_validation.validate(c, n_devices=32, check_paths=False)
    # 256 rows per update over fsdp=32: 8 rows per chip -> 8 micro-batches of one sequence.
    assert (c.mesh.fsdp, c.train.micro_batches) == (32, 8)
    with pytest.raises(ValueError, match="mesh data\\*fsdp\\*expert\\*tensor = 32 but only 8"):
        config_validation.validate(c, n_devices=8, check_paths=False)


def test_arguments():
    c = load("hf_path=/ckpt/q3,max_len=4096,devices=16,expert=4")
    assert (c.model.hf_path, c.tokenizer) == ("/ckpt/q3", "/ckpt/q3/tokenizer.json")
    assert c.rollout.max_new_tokens == 4096 - 1024
    assert (c.mesh.fsdp, c.mesh.expert) == (4, 4)
    with pytest.raises(ValueError, match="devices=8 is not divisible by expert=3"):
        load("expert=3")
    with pytest.raises(ValueError, match="unknown experiment argument 'gpus'"):
        load("gpus=8")


def test_small_variant_is_laptop_sized():
    c = load("small")
    config_validation.validate(c, n_devices=1)
    assert (c.model.preset, c.model.hf_path, c.rollout.engine, c.train.loop) == (
        "tiny", "", "jax", "sync")
    assert (c.tokenizer, c.data.name, c.loss.vocab_size, c.train.steps) == (
        "char", "arith_chains", 128, 2)


def test_parameter_count(model):
    model_config, shapes, _ = model
    assert param_count(model_config) == TOTAL
    assert param_count(model_config, active=True) == ACTIVE
    # The formula counts the parameters the model really creates.
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == TOTAL


def _check_fit(shapes, shardings, mesh_shape: dict) -> int:
    """Asserts every sharded dimension divides by its mesh axes; returns parameters per device."""
    per_device = 0
    leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for x, s in zip(jax.tree.leaves(shapes), leaves, strict=True):
        for size, axes in zip(x.shape, s.spec, strict=False):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
            assert size % math.prod(mesh_shape[a] for a in axes) == 0, (x.shape, s.spec)
        per_device += math.prod(s.shard_shape(x.shape))
    return per_device


def test_shardings_on_eight_devices(model):
    model_config, shapes, _ = model
    c = load()
    mesh = sharding.make_mesh(c.mesh)  # the 8 fake CPU devices of tests/conftest.py
    shardings = sharding.param_shardings(model_config, mesh)  # raises if a dim does not fit
    # the 48 MoE layers are one scanned run, weights [48, ...] whose layers axis is never split
    moe = shardings["scan_0_48"]["layer_0"]["moe"]
    assert tuple(moe["wi_gate"].spec) == (None, "expert", "fsdp", "tensor")
    # fsdp=8 splits every weight's model dimension: wi_gate [128, 2048, 768] -> [128, 256, 768].
    assert moe["wi_gate"].shard_shape((48, 128, 2048, 768)) == (48, 128, 256, 768)
    per_device = _check_fit(shapes, shardings, dict(mesh.shape))
    # Everything but the norm scales is split 8 ways: (30_532_122_624 - 210_944) / 8 + 210_944.
    assert per_device == (TOTAL - NORMS) // 8 + NORMS == 3_816_699_904


def test_expert_parallel_variant_splits_experts(model):
    model_config, shapes, specs = model
    c = load("expert=4")  # 8 devices: fsdp=2 x expert=4
    mesh = sharding.make_mesh(c.mesh)
    shardings = sharding.logical_to_mesh_shardings(specs, mesh)
    sharding.validate_divisibility(model_config, mesh)
    # 128 experts over expert=4 -> 32 per device; d_model 2048 over fsdp=2 -> 1024.
    moe = shardings["scan_0_48"]["layer_0"]["moe"]
    assert moe["wo"].shard_shape((48, 128, 768, 2048)) == (48, 32, 768, 1024)
    assert moe["wi_up"].shard_shape((48, 128, 2048, 768)) == (48, 32, 1024, 768)
    # The dense weights' model dimension is split over fsdp x expert too; the routers [D, E]
    # split E over expert and D over fsdp:
    #   experts 48*603_979_776 = 28_991_029_248 / 8 = 3_623_878_656
    #   embeddings 622_329_856 + attention 48*18_874_368 = 1_528_299_520 / 8 = 191_037_440
    #   routers 48*262_144 / 8 = 1_572_864;   + norms 210_944  -> 3_816_699_904
    assert _check_fit(shapes, shardings, dict(mesh.shape)) == 3_816_699_904


def test_tpu_slice_shardings_without_devices(model):
    _, shapes, specs = model
    c = load("tpu")
    sizes = (c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor)
    mesh = AbstractMesh(sizes, mesh_rules.MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    shardings = sharding.logical_to_mesh_shardings(specs, mesh)
    per_device = _check_fit(shapes, shardings, dict(zip(mesh_rules.MESH_AXES, sizes, strict=True)))
    # 32 chips: 2048 / 32 = 64 of the model dimension per chip.
    assert shardings["scan_0_48"]["layer_0"]["moe"]["wi_gate"].shard_shape(
        (48, 128, 2048, 768)) == (48, 128, 64, 768)
    assert per_device == (TOTAL - NORMS) // 32 + NORMS
