"""The real-scale DeepSeek-V3, GLM-4.5-Air and Qwen3.5-35B-A3B experiments: the first two's
presets are what `hf_deepseek.config_from_hf` makes of the published config.json, their
parameter counts match
the published totals, their weights fit their meshes, and the per-device state their docstrings
state is recomputed (float32 master parameters and AdamW state, exactly, from abstract arrays;
the whole update's memory is XLA:TPU's, `bench aot`, stored in experiments/results)."""

import math
import os

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType
from transformers import DeepseekV3Config, Glm4MoeConfig

from espo_jax import config_validation, configs, mesh_rules, sharding
from espo_jax.bench import aot
from espo_jax.models import get_preset, init_params
from espo_jax.models.flops import param_count
from espo_jax.models.hf_deepseek import config_from_hf
from espo_jax.run_setup import preset_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The docstrings' figures: devices, (fsdp, expert), parameters, active, bytes per device of
# parameters and AdamW state (the preset: the experiment's name unless given).
FIGURES = {
    "deepseek_v3": dict(devices=256, mesh=(32, 8), total=671_026_419_200,
                        active=37_552_297_472, params=10_852_647_936, optimizer=10_852_647_944),
    "glm45_air": dict(devices=32, mesh=(32, 1), total=106_852_251_264, active=13_424_129_664,
                      params=13_360_585_216, optimizer=13_360_585_224),
    "qwen35_moe": dict(preset="qwen35_35b_a3b", devices=16, mesh=(2, 8), total=34_660_610_688,
                       active=3_454_988_928, params=8_669_501_952, optimizer=17_339_003_912),
}


def _preset(name: str) -> str:
    return FIGURES[name].get("preset", name)


def _fmt(n: int) -> str:
    return f"{n:,}"


def _abstract_mesh(fsdp: int, expert: int) -> AbstractMesh:
    return AbstractMesh((1, fsdp, expert, 1), mesh_rules.MESH_AXES,
                        axis_types=(AxisType.Auto,) * 4)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_full_config_validates_on_its_mesh(name):
    f = FIGURES[name]
    c = configs.experiment_config(name)
    config_validation.validate(c, n_devices=f["devices"], check_paths=False)
    assert (c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor) == (1, *f["mesh"], 1)
    # 128 prompts x 8 = 1024 rows, 4 updates of 256, one row per batch shard (fsdp x expert)
    # each micro-batch (DeepSeek-V3's 256 shards: 1; GLM's 32: 8; Qwen3.5's 16: 16)
    assert c.train.micro_batches == 256 // (f["mesh"][0] * f["mesh"][1])
    assert c.train.replay == "r3"
    assert c.rollout.max_prompt_len + c.rollout.max_new_tokens == 16384
    assert c.model.preset == _preset(name) and preset_model_config(c).remat
    with pytest.raises(ValueError, match="is not divisible by expert=3"):
        configs.experiment_config(name, "expert=3")


def test_presets_are_the_published_config_json():
    # DeepSeek-V3's config.json: DeepseekV3Config's defaults with its YaRN rope_scaling
    v3 = DeepseekV3Config(max_position_embeddings=163840, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)).to_dict()
    assert config_from_hf(v3, "bfloat16") == get_preset("deepseek_v3", dispatch="dropless_loop")
    # GLM-4.5-Air's: Glm4MoeConfig's defaults with head_dim 128 (the default derives 4096 / 96),
    # attention_bias and rope_theta 1e6
    air = Glm4MoeConfig(head_dim=128, attention_bias=True, rope_parameters=dict(
        rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5)).to_dict()
    assert config_from_hf(air, "bfloat16") == get_preset("glm45_air", dispatch="dropless_loop")


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_parameter_counts_match_the_published_totals(name):
    f = FIGURES[name]
    c = get_preset(_preset(name))
    assert (param_count(c), param_count(c, active=True)) == (f["total"], f["active"])
    shapes = jax.eval_shape(lambda: init_params(c, jax.random.key(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == f["total"]
    embeddings = 2 * c.vocab_size * c.d_model
    if name == "deepseek_v3":  # 671B total, 37B active (embeddings counted)
        assert abs(f["total"] / 671e9 - 1) < 0.001 and abs(f["active"] / 37e9 - 1) < 0.02
    elif name == "qwen35_moe":  # 35B total (the text model), 3B active ("A3B")
        assert abs(f["total"] / 35e9 - 1) < 0.01 and 3e9 < f["active"] < 3.5e9
    else:  # 106B total, 12B active (embeddings not counted)
        assert abs(f["total"] / 106e9 - 1) < 0.01
        assert abs((f["active"] - embeddings) / 12e9 - 1) < 0.02


def test_mla_and_shared_expert_shardings():
    c = get_preset("deepseek_v3")
    specs = sharding.logical_specs(c.replace(n_layers=4))  # 3 dense layers + 1 MoE layer
    s = sharding.logical_to_mesh_shardings(specs, _abstract_mesh(32, 8))
    attn, moe = s["layers_3"]["attn"], s["layers_3"]["moe"]
    # q_a [7168, 1536] and kv_a [7168, 576]: embed over fsdp x expert, 7168 / 256 (the low
    # rank gives way); q_b [1536, 128*192] and kv_b [512, 128*256]: the low rank over fsdp
    assert attn["q_a_proj"]["kernel"].shard_shape((7168, 1536)) == (28, 1536)
    assert attn["kv_a_proj"]["kernel"].shard_shape((7168, 576)) == (28, 576)
    assert attn["q_b_proj"]["kernel"].shard_shape((1536, 24576)) == (48, 24576)
    assert attn["kv_b_proj"]["kernel"].shard_shape((512, 32768)) == (16, 32768)
    assert attn["o_proj"]["kernel"].shard_shape((16384, 7168)) == (16384, 28)
    # 256 experts over expert=8 -> 32 per device, their model dimension over fsdp=32 (expert
    # is taken); the shared expert is a dense MLP: over fsdp x expert
    assert moe["wi_gate"].shard_shape((256, 7168, 2048)) == (32, 224, 2048)
    assert moe["shared_experts"]["gate_proj"]["kernel"].shard_shape((7168, 2048)) == (28, 2048)
    assert moe["shared_experts"]["down_proj"]["kernel"].shard_shape((2048, 7168)) == (2048, 28)
    # the rules are the config's: with q_lora unmapped q_b keeps its rank dim whole
    mesh = AbstractMesh((1, 8, 1, 4), mesh_rules.MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    default = sharding.logical_to_mesh_shardings(specs, mesh)["layers_3"]["attn"]
    assert default["q_b_proj"]["kernel"].shard_shape((1536, 24576)) == (192, 6144)
    rules = tuple((k, None if k == "q_lora" else v) for k, v in mesh_rules.DEFAULT_RULES)
    moved = sharding.logical_to_mesh_shardings(specs, mesh, rules)["layers_3"]["attn"]
    assert moved["q_b_proj"]["kernel"].shard_shape((1536, 24576)) == (1536, 6144)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_state_bytes_per_device(name):
    f = FIGURES[name]
    c = get_preset(_preset(name))
    moment_dtype = configs.experiment_config(name).optim.moment_dtype
    got = aot.state_bytes(c, _abstract_mesh(*f["mesh"]), moment_dtype=moment_dtype)
    assert (got["params"], got["optimizer"]) == (f["params"], f["optimizer"])
    # By hand: the float32 masters split over fsdp x expert (experts: E over expert, their model
    # dimension over fsdp; MLA's up-projections over fsdp on their low-rank side), the RMSNorm
    # scales, GLM's q/k/v biases (heads -> tensor = 1) and the fp32 correction biases whole;
    # Qwen3.5's q/k norms, and its Gated DeltaNet layers' conv kernels, A_log, dt_bias and
    # output norm.
    d, m, lora = c.d_model, c.n_moe_layers, 0
    biases = m * c.n_experts if c.router == "sigmoid_group" else 0
    experts = m * c.n_experts * 3 * d * c.d_expert
    norms = c.n_layers * 2 * d + d
    if c.linear_layers:
        n_lin = len(c.linear_layers)
        qk = c.linear_n_key_heads * c.linear_key_head_dim
        v = c.linear_n_value_heads * c.linear_value_head_dim
        whole = norms + (c.n_layers - n_lin) * 2 * c.head_dim + n_lin * (
            c.linear_conv_kernel * (2 * qk + v) + 2 * c.linear_n_value_heads
            + c.linear_value_head_dim)
    elif c.attention == "mla":
        norms += c.n_layers * (c.q_lora_rank + c.kv_lora_rank)
        whole = norms
        lora = c.n_layers * c.n_heads * (
            c.q_lora_rank * (c.qk_nope_head_dim + c.qk_rope_head_dim)
            + c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim))
    else:
        whole = norms + c.n_layers * c.head_dim * (c.n_heads + 2 * c.n_kv_heads)
    fsdp, expert = f["mesh"]
    rest = param_count(c) - experts - whole - biases - lora
    assert f["params"] == 4 * (experts // (fsdp * expert) + rest // (fsdp * expert)
                               + lora // fsdp + whole + biases)
    # AdamW: two moments per parameter (float32; bf16 for DeepSeek-V3 and GLM-4.5-Air: half
    # the masters' bytes each), plus two int32 step counts (Adam's bias correction, the
    # learning-rate schedule's)
    moment_bytes = {"float32": 4, "bfloat16": 2}[moment_dtype]
    assert f["optimizer"] == 2 * f["params"] * moment_bytes // 4 + 8


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_docstring_states_the_figures(name):
    doc = configs.import_file(os.path.join(REPO, "experiments", f"{name}.py")).__doc__
    doc = " ".join(doc.split())
    for key in ("total", "active", "params", "optimizer"):
        assert _fmt(FIGURES[name][key]) in doc, (key, FIGURES[name][key])
    assert f"{FIGURES[name]['devices']}-device learner mesh" in doc
