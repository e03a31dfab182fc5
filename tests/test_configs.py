"""`config_validation.validate`: every bad value named with its key and the allowed values, all
at once, before anything is compiled (divisibility with the numbers, the mesh against the
devices)."""

import json
import pathlib
import re
import sys

import pytest

from espo_jax import config_validation, configs


def _small():
    c = configs.default_config()
    configs.apply_small(c)  # 4 prompts x 4 samples = 16 rows per rollout batch
    return c


def test_default_and_small_configs_validate():
    config_validation.validate(configs.default_config(), n_devices=1)
    config_validation.validate(_small(), n_devices=1)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.replay", "bogus", "config.train.replay='bogus' is not one of ('r3', 'r2', 'off')"),
        ("train.loop", "fast", "config.train.loop='fast' is not one of ('sync', 'async')"),
        ("rollout.precision", "int4",
         "config.rollout.precision='int4' is not one of ('fp32', 'bf16', 'fp8', 'fp8_block')"),
        ("advantage.name", "ppo",
         "config.advantage.name='ppo' is not one of ('grpo', 'dr_grpo', 'rloo')"),
        ("model.preset", "huge", "config.model.preset='huge' is not one of ('tiny', 'small'"),
        ("loss.name", "ppo_kl", "config.loss: loss 'ppo_kl' is not registered; registered: "
         "['dapo', 'espo', 'grpo', 'gspo', 'gspo_token']. Register your own with the decorator "
         "`@espo_jax.rl.losses.register(NAME, aggregation=...)` in a module of your own, and "
         "import that module with --config.imports=MODULE"),
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
        config_validation.validate(c, n_devices=1)
    assert message in str(e.value)


def test_anchor_needs_warm_start_levels():
    c = _small()
    c.train.anchor_coef = 0.5
    config_validation.validate(c, n_devices=1)
    c.mesh.data = 2
    c.train.anchor_rows = 3  # rows of the anchor batch are split over the data shards
    with pytest.raises(ValueError, match=r"anchor rows 3 .* not divisible by the batch shards "
                                         r"\(mesh.data x mesh.fsdp x mesh.expert of"):
        config_validation.validate(c, n_devices=2)
    c.warmstart.levels = ()
    with pytest.raises(ValueError, match="config.warmstart.levels is empty"):
        config_validation.validate(c, n_devices=2)


def test_negative_attention_chunk_is_rejected():
    c = _small()
    c.model.attention_chunk = -8
    with pytest.raises(ValueError, match=r"config.model.attention_chunk must be >= 0"):
        config_validation.validate(c, n_devices=1)


def test_divisibility_messages_name_the_numbers():
    c = _small()
    c.train.updates_per_batch = 3
    with pytest.raises(ValueError) as e:
        config_validation.validate(c, n_devices=1)
    # 4 prompts x 4 samples = 16 rows, not a multiple of 3 updates.
    assert ("rollout rows prompts_per_step*zve.n_samples = 16 not divisible by "
            "train.updates_per_batch = 3") in str(e.value)
    c = _small()
    c.train.updates_per_batch = 2  # 8 rows per update
    c.train.micro_batches = 2
    c.train.pack = False  # micro-batches need one row per sequence
    c.mesh.data = 3
    with pytest.raises(ValueError) as e:
        config_validation.validate(c, n_devices=8)
    # 8 rows over 2 micro-batches x 3 data shards (6) leave a remainder.
    assert ("rows per update 8 not divisible by train.micro_batches * the batch shards "
            "(mesh.data x mesh.fsdp x mesh.expert of config.mesh.rules' batch rule) = 2 * 3"
            ) in str(e.value)
    c.mesh.data = 1  # one device: the update's rows in 2 parts of 2 micro-batches
    c.train.micro_batches = 8
    with pytest.raises(ValueError, match=r"rows per update 8 not divisible by "
                                         r"train.grad_threads \* train.micro_batches = 2 \* 8"):
        config_validation.validate(c, n_devices=8)
    c.train.micro_batches = 2
    config_validation.validate(c, n_devices=8)
    c.mesh.data = 2  # 2 * 2 = 4 divides 8
    config_validation.validate(c, n_devices=8)
    c.rollout.engine_shards = 3  # the small config's 16 slots do not split in 3
    with pytest.raises(ValueError, match=r"rollout.num_slots = 16 not divisible by "
                                         r"rollout.engine_shards = 3"):
        config_validation.validate(c, n_devices=8)
    c.rollout.engine_shards = 0  # auto: the engine picks a divisor of the slots
    config_validation.validate(c, n_devices=8)
    c.rollout.engine_shards = -1
    with pytest.raises(ValueError, match=r"rollout.engine_shards"):
        config_validation.validate(c, n_devices=8)


def test_packing_refuses_micro_batches():
    c = _small()
    c.train.micro_batches = 2
    with pytest.raises(ValueError, match=r"train.pack=True needs train.micro_batches == 1 "
                                         r"\(got 2\)"):
        config_validation.validate(c, n_devices=1)
    c.train.pack = False
    config_validation.validate(c, n_devices=1)


def test_mesh_larger_than_devices():
    c = _small()
    c.mesh.data, c.mesh.expert = 2, 4
    config_validation.validate(c, n_devices=8)
    with pytest.raises(ValueError, match="mesh data\\*fsdp\\*expert\\*tensor = 8 but only 4 "
                                         "devices are visible"):
        config_validation.validate(c, n_devices=4)


def test_every_problem_is_listed_at_once():
    c = _small()
    c.train.replay, c.rollout.engine = "r9", "trt"
    with pytest.raises(ValueError) as e:
        config_validation.validate(c, n_devices=1)
    assert "config.train.replay='r9'" in str(e.value)
    assert "config.rollout.engine='trt' is not one of ('jax', 'vllm')" in str(e.value)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("optim.lr", -1.0, "config.optim.lr must be > 0.0, got -1.0"),  # gradient ascent
        ("eval.num_prompts", -3, "config.eval.num_prompts must be >= 1, got -3"),
        ("checkpoint.every", 0, "config.checkpoint.every must be >= 1, got 0"),
        ("checkpoint.keep", 0, "config.checkpoint.keep must be >= 1, got 0"),
        ("eval.pass_k", -1, "config.eval.pass_k must be >= 0, got -1"),
        ("rollout.top_p", 1.5, "config.rollout.top_p must be > 0.0 and <= 1.0, got 1.5"),
        ("rollout.top_k", -2, "config.rollout.top_k must be >= 0, got -2"),
        ("rollout.reward_timeout_s", 0.0, "config.rollout.reward_timeout_s must be > 0.0"),
        ("optim.warmup_steps", -1, "config.optim.warmup_steps must be >= 0, got -1"),
        ("train.max_staleness", -1, "config.train.max_staleness must be >= 0, got -1"),
        ("zve.zvp.alpha", -0.1, "config.zve.zvp.alpha must be >= 0.0, got -0.1"),
        ("rollout.max_inflight_batches", 0,
         "config.rollout.max_inflight_batches must be >= 1, got 0"),
        ("rollout.max_failed_reward_frac", 1.5,
         "config.rollout.max_failed_reward_frac must be >= 0.0 and <= 1.0, got 1.5"),
        ("rollout.max_failed_reward_frac", -0.1,
         "config.rollout.max_failed_reward_frac must be >= 0.0 and <= 1.0, got -0.1"),
        ("train.worker_timeout_s", 0.0, "config.train.worker_timeout_s must be > 0.0, got 0.0"),
        ("train.worker_restarts", -1, "config.train.worker_restarts must be >= 0, got -1"),
        ("data.eval_levels", (1, 7), "config.data.eval_levels has levels [7] outside 1..5"),
    ],
)
def test_out_of_range_values_are_named(key, value, message):
    c = configs.default_config()
    section, *rest = key.split(".")
    target = c[section]
    for part in rest[:-1]:
        target = target[part]
    target[rest[-1]] = value
    with pytest.raises(ValueError, match="invalid config") as e:
        config_validation.validate(c, n_devices=1)
    assert message in str(e.value)


def _with(overrides: dict):
    c = configs.default_config()
    for key, value in overrides.items():
        *path, name = key.split(".")
        target = c
        for part in path:
            target = target[part]
        target[name] = value
    return c


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train.loop": "async", "train.max_staleness": 0},
         "config.train.loop='async' needs config.train.max_staleness >= 1, got 0: a worker "
         "samples the next batch while the learner trains on the current one"),
        ({"train.loop": "async", "train.num_workers": 3},  # 16 prompts over 3 workers
         "rollout.prompts_per_step = 16 not divisible by train.num_workers = 3 "
         "(train.loop='async': each worker's batch is prompts_per_step / num_workers groups)"),
        ({"rollout.engine": "vllm"},
         "config.rollout.engine='vllm' with config.mode='train' needs config.train.loop='async', "
         "got 'sync': the single-process loop samples with the embedded JAX engine"),
    ],
)
def test_combinations_the_layout_cannot_run(overrides, message):
    with pytest.raises(ValueError, match="invalid config") as e:
        config_validation.validate(_with(overrides), n_devices=1)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {"train.loop": "async"},  # defaults: staleness 1, 16 prompts over 2 workers
        {"train.loop": "async", "train.num_workers": 0, "rollout.prompts_per_step": 7},
        {"train.loop": "sync", "train.max_staleness": 0, "train.num_workers": 3},
        {"train.loop": "async", "rollout.engine": "vllm"},
        {"mode": "rollout", "rollout.engine": "vllm"},  # a vLLM worker's own config
        {"train.loop": "async", "zve.offline.enabled": True, "zve.offline.early_stop": True},
    ],
)
def test_combinations_the_layout_can_run(overrides):
    config_validation.validate(_with(overrides), n_devices=1)


# ---- every leaf of default_config() ------------------------------------------------------------
# Free-form leaves: any value of their type means something (booleans are type-checked by
# ml_collections itself). Every other leaf is validated: a wrong value is an error naming it.
FREE = {
    "buffer.dir": "a directory the run creates",
    "data.data_dir": "a directory the run creates",
    "data.jsonl_train": "read only by math_jsonl (then required and checked)",
    "data.jsonl_test": "read only by math_jsonl (then required and checked)",
    "mesh.rules": "any logical-axis rules (mesh_rules.rules_from_config reads them)",
    "model.aux_loss_coef": "< 0 keeps the model's own weight",
    "warmstart.levels": "read only when warmstart.steps > 0 (then checked)",
    "zve.offline.low": "< 0 keeps the never-solved prompts",
}
def _leaves(config, prefix=""):
    for key, value in config.items():
        if hasattr(value, "items"):
            yield from _leaves(value, prefix + key + ".")
        else:
            yield prefix + key, value


def _generic_wrong(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return type(value)(-1)
    if isinstance(value, str):
        return "/nonexistent/bogus"
    return ()


def test_every_leaf_is_validated_or_free_form():
    leaves = dict(_leaves(configs.default_config()))
    assert set(FREE) <= set(leaves)
    checked = 0
    for key, value in leaves.items():
        wrong = _generic_wrong(value)
        if key in FREE or wrong is None:
            assert key in FREE or isinstance(value, bool), key
            continue
        c = configs.default_config()
        node = c
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        node[leaf] = wrong
        with pytest.raises(ValueError) as raised:
            config_validation.validate(c, n_devices=8)
        # loss.* and zve.* are checked by their own modules, which name the key inside them.
        named = key.split(".", 1)[1] if key.startswith(("loss.", "zve.")) else key
        assert named in str(raised.value), (key, str(raised.value)[:300])
        checked += 1
    assert checked == len(leaves) - len(FREE) - sum(isinstance(v, bool) for v in leaves.values())
    assert checked >= 110


def test_the_issue_bad_values_and_the_free_leaves_checks():
    c = configs.default_config()
    c.optim.lr, c.eval.num_prompts, c.checkpoint.every = -1.0, -3, 0
    with pytest.raises(ValueError) as raised:
        config_validation.validate(c, n_devices=1)
    for key in ("optim.lr", "eval.num_prompts", "checkpoint.every"):
        assert f"config.{key}" in str(raised.value)
    c = configs.default_config()
    c.warmstart.steps, c.warmstart.levels = 10, ()
    with pytest.raises(ValueError, match="warmstart.steps > 0 needs config.warmstart.levels"):
        config_validation.validate(c, n_devices=1)
    c = configs.default_config()
    c.data.name = "math_jsonl"
    with pytest.raises(ValueError, match="config.data.jsonl_train must be set"):
        config_validation.validate(c, n_devices=1)
    c.data.jsonl_train, c.data.jsonl_test = "/nonexistent/a.jsonl", "/nonexistent/b.jsonl"
    with pytest.raises(ValueError, match=r"config.data.jsonl_train='/nonexistent/a.jsonl' does"):
        config_validation.validate(c, n_devices=1)
    config_validation.validate(c, n_devices=1, check_paths=False)  # on paper: paths not looked for
    c = configs.default_config()
    c.tokenizer = "model"
    with pytest.raises(ValueError, match="config.tokenizer='model'.*needs config.model.hf_path"):
        config_validation.validate(c, n_devices=1)


# ---- optional packages: named with their extra before any work ---------------------------------
def test_a_gguf_checkpoint_without_its_packages_names_them_and_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")  # never read: validation looks at the name and the cache only
    c = configs.default_config()
    c.model.hf_path = str(path)
    config_validation.validate(c, n_devices=1)  # all of them installed here
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(ValueError) as raised:
        config_validation.validate(c, n_devices=1)
    assert (f"config.model.hf_path={str(path)!r}: GGUF checkpoints (read through transformers) "
            "need the packages gguf, accelerate (not installed): pip install -e '.[gguf]'"
            in str(raised.value))
    config_validation.validate(c, n_devices=1, check_paths=False)  # on paper: not looked for


def test_parquet_prompt_files_without_pyarrow_name_it_and_the_extra(tmp_path, monkeypatch):
    for name in ("train.jsonl", "test.parquet"):
        (tmp_path / name).write_text("")
    c = _small()
    c.task = "files"
    c.task_args = json.dumps({"train": str(tmp_path / "train.jsonl"),
                              "test": str(tmp_path / "test.parquet")})
    config_validation.validate(c, n_devices=1)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ValueError, match=re.escape(
            "config.task_args test: Parquet prompt files need the package pyarrow (not "
            "installed): pip install -e '.[parquet]'")):
        config_validation.validate(c, n_devices=1)
    c.task_args = json.dumps({"train": str(tmp_path / "train.jsonl"),
                              "test": str(tmp_path / "train.jsonl")})
    config_validation.validate(c, n_devices=1)  # JSONL only: pyarrow is not needed


def test_setup_extras_install_what_the_optional_paths_import(monkeypatch):
    import runpy

    import setuptools

    from espo_jax import extras

    setup = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: setup.update(kw))
    runpy.run_path(str(pathlib.Path(__file__).parents[1] / "setup.py"))
    required = setup["extras_require"]
    for extra, (_, modules) in extras.EXTRAS.items():
        pinned = {r.split("==")[0] for r in required[extra]}
        assert pinned == set(modules), extra  # distribution and module names agree here
        assert all("==" in r for r in required[extra]), required[extra]
        assert set(required[extra]) <= set(required["test"]), extra  # the tests cover them
