"""The main job's config checks: `configs.validate` names the key and the allowed values, and
`python -m espo_jax.main` stops on a bad value before anything is compiled or written; its
command line (the rollout workers' flags, absl's usage errors) and `--config.mode=rollout`."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from espo_jax import configs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small():
    c = configs.default_config()
    configs.apply_small(c)  # 4 prompts x 4 samples = 16 rows per rollout batch
    return c


def test_default_and_small_configs_validate():
    configs.validate(configs.default_config(), n_devices=1)
    configs.validate(_small(), n_devices=1)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.replay", "bogus", "config.train.replay='bogus' is not one of ('r3', 'r2', 'off')"),
        ("train.loop", "fast", "config.train.loop='fast' is not one of ('sync', 'async')"),
        ("rollout.precision", "int4",
         "config.rollout.precision='int4' is not one of ('fp32', 'bf16', 'fp8')"),
        ("advantage.name", "ppo",
         "config.advantage.name='ppo' is not one of ('grpo', 'dr_grpo', 'rloo')"),
        ("model.preset", "huge", "config.model.preset='huge' is not one of ('tiny', 'small'"),
        ("loss.name", "ppo_kl", "name='ppo_kl' is not one of ['grpo', 'dapo', 'gspo'"),
        ("train.steps", -1, "config.train.steps must be >= 0 (0: warm start only), got -1"),
        ("train.micro_batches", 0, "config.train.micro_batches must be >= 1, got 0"),
        ("warmstart.max_seconds", -5.0, "config.warmstart.max_seconds must be >= 0"),
        ("advantage.negative_scale", 1.5,
         "config.advantage.negative_scale must be in [0, 1], got 1.5"),
        ("model.rope_theta", -1.0, "config.model.rope_theta must be >= 0 (0: the preset's)"),
        ("train.anchor_coef", -0.5, "config.train.anchor_coef and config.train.anchor_rows "
         "must be >= 0, got -0.5 and 0"),
        ("rollout.temperature", 0.0, "config.rollout.temperature must be > 0, got 0.0"),
    ],
)
def test_bad_choice_names_key_and_allowed_values(key, value, message):
    c = _small()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ValueError, match="invalid config") as e:
        configs.validate(c, n_devices=1)
    assert message in str(e.value)


def test_anchor_needs_warm_start_levels():
    c = _small()
    c.train.anchor_coef = 0.5
    configs.validate(c, n_devices=1)
    c.mesh.data = 2
    c.train.anchor_rows = 3  # rows of the anchor batch are split over the data shards
    with pytest.raises(ValueError, match=r"anchor rows 3 .* not divisible by mesh.data"):
        configs.validate(c, n_devices=2)
    c.warmstart.levels = ()
    with pytest.raises(ValueError, match="config.warmstart.levels is empty"):
        configs.validate(c, n_devices=2)


def test_step_credit_needs_arith_worked_solutions_and_stage_2():
    from espo_jax import tasks

    c = _small()
    assert tasks.reward_fn(c)[1] is None  # the default: the verifier on the answer
    c.zve.tie_break.wrong_score = "step_credit"
    c.zve.tie_break.enabled = True
    configs.validate(c, n_devices=1)
    reward, target = tasks.reward_fn(c)
    prompt = {"answer": "9", "solution": "a5=5,b+7=12,c-3=9#9"}
    assert reward("a5=5,b+7=12,c-3=8#8", target(prompt)) == {
        "reward": 0.0, "outcome": False, "step_credit": pytest.approx(2 / 3)}
    c.zve.tie_break.wrong_score = "partial"
    with pytest.raises(ValueError, match=r"wrong_score 'partial' is not one of \('zero'"):
        configs.validate(c, n_devices=1)
    c.zve.tie_break.wrong_score = "step_credit"
    c.zve.tie_break.enabled = False
    with pytest.raises(ValueError, match="needs worked solutions .* enabled=False"):
        configs.validate(c, n_devices=1)


def test_model_overrides_apply_only_when_set():
    from espo_jax.run_setup import preset_model_config

    c = _small()
    assert preset_model_config(c).rope_theta == 1e6  # the tiny preset keeps Qwen3's base
    c.model.rope_theta = 1e4
    assert preset_model_config(c).rope_theta == 1e4
    assert preset_model_config(c).d_model == 64  # the rest of the preset is untouched
    assert preset_model_config(c).aux_loss_coef == 1e-3
    c.model.aux_loss_coef = 0.0  # 0 switches the load-balancing loss off; < 0 keeps the preset's
    assert preset_model_config(c).aux_loss_coef == 0.0


def test_run_choices_apply_to_hugging_face_weights(tmp_path):
    """Dispatch, remat, attention chunk and the aux-loss weight are the run's choice also when
    the architecture comes from a Hugging Face config.json (which knows none of them)."""
    import jax

    from espo_jax.models import get_preset, hf_io, init_params
    from espo_jax.run_setup import load_model

    tiny_params = jax.jit(init_params, static_argnums=0)(get_preset("tiny"), jax.random.key(0))
    hf_io.save_pretrained(get_preset("tiny"), tiny_params, str(tmp_path))
    c = _small()
    c.model.hf_path = str(tmp_path)
    c.model.dispatch, c.model.remat, c.model.attention_chunk = "ragged", True, 64
    c.model.aux_loss_coef = 0.0
    model_config, params = load_model(c)
    assert (model_config.dispatch, model_config.remat, model_config.attention_chunk,
            model_config.aux_loss_coef) == ("ragged", True, 64, 0.0)
    assert model_config.d_model == get_preset("tiny").d_model
    np.testing.assert_array_equal(params["embed"]["embedding"],
                                  tiny_params["embed"]["embedding"])


def test_negative_attention_chunk_is_rejected():
    c = _small()
    c.model.attention_chunk = -8
    with pytest.raises(ValueError, match=r"config.model.attention_chunk must be >= 0"):
        configs.validate(c, n_devices=1)


def test_divisibility_messages_name_the_numbers():
    c = _small()
    c.train.updates_per_batch = 3
    with pytest.raises(ValueError) as e:
        configs.validate(c, n_devices=1)
    # 4 prompts x 4 samples = 16 rows, not a multiple of 3 updates.
    assert ("rollout rows prompts_per_step*zve.n_samples = 16 not divisible by "
            "train.updates_per_batch = 3") in str(e.value)
    c = _small()
    c.train.updates_per_batch = 2  # 8 rows per update
    c.train.micro_batches = 2
    c.mesh.data = 3
    with pytest.raises(ValueError) as e:
        configs.validate(c, n_devices=8)
    # 8 rows over 2 micro-batches x 3 data shards (6) leave a remainder.
    assert ("rows per update 8 not divisible by train.micro_batches * mesh.data * mesh.fsdp = "
            "2 * 3 * 1") in str(e.value)
    c.mesh.data = 2  # 2 * 2 = 4 divides 8
    configs.validate(c, n_devices=8)


def test_mesh_larger_than_devices():
    c = _small()
    c.mesh.data, c.mesh.expert = 2, 4
    configs.validate(c, n_devices=8)
    with pytest.raises(ValueError, match="mesh data\\*fsdp\\*expert\\*tensor = 8 but only 4 "
                                         "devices are visible"):
        configs.validate(c, n_devices=4)


def test_every_problem_is_listed_at_once():
    c = _small()
    c.train.replay, c.rollout.engine = "r9", "trt"
    with pytest.raises(ValueError) as e:
        configs.validate(c, n_devices=1)
    assert "config.train.replay='r9'" in str(e.value)
    assert "config.rollout.engine='trt' is not one of ('jax', 'vllm')" in str(e.value)


def test_main_rejects_bad_value_before_compiling(tmp_path):
    workdir = tmp_path / "run"
    env = dict(os.environ, JAX_LOG_COMPILES="1")  # every jit compile would be logged
    proc = subprocess.run(
        [sys.executable, "-m", "espo_jax.main", "--config",
         os.path.join(REPO, "experiments", "arith_espo.py:small"), "--workdir", str(workdir),
         "--config.train.replay=bogus"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config.train.replay='bogus' is not one of ('r3', 'r2', 'off')" in out
    assert "Compiling" not in out and "Finished tracing" not in out
    assert not workdir.exists()  # nothing prepared or written: no data, no checkpoints


def _main(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "espo_jax.main", "--config",
                           os.path.join(REPO, "experiments", "arith_espo.py:small"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_main_takes_the_rollout_workers_flags():
    helped = subprocess.run([sys.executable, "-m", "espo_jax.main", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    for flag in ("--config", "--workdir", "--worker_index", "--num_workers", "--max_batches",
                 "--until_version", "--stats", "--coordinator_address"):
        assert f"  {flag}: " in helped.stdout, (flag, helped.stdout)
    bad = _main("--workdir", "/nonexistent/run", "--publish_dir=w")
    assert bad.returncode == 1 and "Unknown command line flag 'publish_dir'" in bad.stderr


def test_rollout_mode_starts_the_configured_engine(tmp_path):
    """`--config.mode=rollout`: the JAX worker with rollout.engine=jax (here until
    `--max_batches=0`: it loads the published weights, writes its counters and stops), the
    vLLM worker with rollout.engine=vllm (here without vLLM: it says so before anything runs)."""
    import importlib.util

    import jax

    from espo_jax import models
    from espo_jax.buffer import weights

    tiny = models.get_preset("tiny")
    weights.publish(tmp_path / "weights", 3, tiny,
                    jax.device_get(models.init_params(tiny, jax.random.key(0))))
    stats = tmp_path / "stats.json"
    jax_worker = _main("--workdir", str(tmp_path), "--config.mode=rollout",
                       "--config.rollout.engine=jax", "--max_batches=0", f"--stats={stats}")
    assert jax_worker.returncode == 0, jax_worker.stderr[-3000:]
    counters = json.loads(stats.read_text())
    assert (counters["worker/batches"], counters["worker/policy_version"]) == (0, 3)
    if importlib.util.find_spec("vllm") is None:
        vllm_worker = _main("--workdir", str(tmp_path / "vllm"), "--config.mode=rollout",
                            "--config.rollout.engine=vllm", timeout=120)
        assert vllm_worker.returncode == 1 and "vLLM is not importable" in vllm_worker.stderr
        assert not (tmp_path / "vllm").exists()
