"""Every experiment config loads, validates, and (small variant) runs 2 RL steps end to end in
this process: real TFDS data, warm start, FP8 engine, reward pool, buffer, learner, orbax
checkpoints, summary.json and metrics.jsonl. One process, so repeated compilations hit the
in-process and persistent caches. Real-scale experiments are validated, shaped (eval_shape) and
sharded on paper; only their small variants run."""

import glob
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers.env import one_device_env
from jax.sharding import AbstractMesh, AxisType

from espo_jax import config_validation, configs, mesh_rules, plot, run_setup, sharding
from espo_jax.models import init_params
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.train import loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `*_common.py` files are recipes the experiments share (no `get_config` of their own); task
# modules are what a config's `task` names (tests/test_tasks.py runs them).
TASK_MODULES = {"my_task", "my_loss"}  # my_loss: what `--config.imports` names
EXPERIMENTS = sorted(name for name in (os.path.basename(p)[:-3] for p in glob.glob(
    os.path.join(REPO, "experiments", "*.py"))) if not name.endswith("_common")
    and name not in TASK_MODULES)
ARITH = ("arith_espo", "arith_grpo", "arith_dapo", "arith_gspo", "arith_gspo_token")
# Full size validated and shaped here (on the learner devices they name); their small variants
# run. deepseek_v3 and glm45_air: tests/test_scale_configs.py holds their memory figures.
REAL_SCALE = {"qwen3_30b_a3b": 8, "deepseek_v3": 256, "glm45_air": 32, "qwen35_moe": 16}
# Small variants of another model family than the default's (their presets' tiny versions)
FAMILY_PRESETS = {"deepseek_v3": "tiny_deepseek_v3", "glm45_air": "tiny_glm45",
                  "qwen35_moe": "tiny_qwen35_moe"}
# The worker layout's experiments: the keys they change from the default (the workers' count and
# staleness they set equal the defaults').
LAYOUT = {"arith_espo_async": {"train.loop", "rollout.reward_workers"}}
# Experiments that start from a pretrained checkpoint: their small variant keeps the model (a
# subprocess runs it in tests/models/test_smollm2.py, not this one).
PRETRAINED = {"smollm2_chain_sum"}
SUMMARY_KEYS = ("warmstart_accuracy", "final_accuracy", "steps", "wall_seconds",
                "generated_tokens", "no_signal_token_frac", "no_signal_token_frac_with_offline",
                "mean_abs_logp_mismatch",
                "warmstart_steps", "warmstart_seconds", "rl_seconds")


def load(name, arg=None):
    module = configs.import_file(os.path.join(REPO, "experiments", f"{name}.py"))
    assert f"python -m espo_jax.main --config experiments/{name}.py" in module.__doc__, (
        f"{name}: the docstring must hold the command that runs it")
    assert "Measured" in module.__doc__, f"{name}: the docstring must say what it measured"
    return module.get_config(arg)


def _flat(config):
    """{"a.b.c": value} of a ConfigDict."""
    out = {}
    for key, value in config.items():
        if hasattr(value, "items"):
            out.update({f"{key}.{k}": v for k, v in _flat(value).items()})
        else:
            out[key] = value
    return out


def test_the_arith_family_is_there():
    assert set(ARITH) <= set(EXPERIMENTS)
    assert "arith_common" not in EXPERIMENTS
    assert configs.experiment_config("arith_espo").to_dict() == load("arith_espo").to_dict()


@pytest.mark.parametrize("arg", [None, "small"])
def test_the_arith_experiments_differ_by_the_loss_only(arg):
    full = {name: load(name, arg) for name in ARITH}
    base = _flat(full["arith_espo"])
    for name, config in full.items():
        flat = _flat(config)
        assert flat.keys() == base.keys()
        diff = {k for k in flat if flat[k] != base[k]}
        assert diff <= {"loss.name", "loss.clip_low", "loss.clip_high"}, (name, diff)
        # The loss section is the paper's for that loss, at the character tokenizer's |V|.
        paper = paper_loss_config(name.split("_", 1)[1])
        paper.vocab_size = 128
        assert config.loss.to_dict() == paper.to_dict(), name


@pytest.mark.parametrize("name", ARITH)
def test_the_small_arith_variant_is_apply_small_of_the_full_one(name):
    assert load(name, "small").to_dict() == configs.apply_small(load(name)).to_dict()


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_loads_and_validates(name):
    full, small = load(name), load(name, "small")
    config_validation.validate(full, n_devices=REAL_SCALE.get(name, jax.device_count()),
                               check_paths=name not in REAL_SCALE)
    config_validation.validate(small, n_devices=jax.device_count())
    assert small.train.steps == 2
    tiny = FAMILY_PRESETS.get(name, "tiny")
    assert (small.model.preset == tiny) != (name in PRETRAINED)
    if name not in ARITH and name not in LAYOUT:
        return
    base = _flat(load("arith_espo"))
    diff = {k for k, v in _flat(full).items() if base[k] != v}
    if name in LAYOUT:
        # The worker layout runs the default recipe; only where and how it runs differs.
        assert diff == LAYOUT[name], diff
        return
    # The arith baselines differ from the default experiment by the loss only.
    assert {k.split(".")[0] for k in diff} <= {"loss"}, diff
    assert full.loss.name == name.split("_", 1)[1]


# Every file in experiments/ with a `get_config`, whatever the lists above say.
CONFIG_FILES = sorted(p for p in glob.glob(os.path.join(REPO, "experiments", "*.py"))
                      if "def get_config(" in open(p).read())


def test_every_experiment_is_in_the_list():
    assert {os.path.basename(p)[:-3] for p in CONFIG_FILES} == set(EXPERIMENTS)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_a_mistyped_argument_is_refused_naming_the_accepted_ones(path):
    """`:smal` (for `:small`) is an error listing what the experiment accepts, not the full
    experiment run instead."""
    module = configs.import_file(path)
    with pytest.raises(ValueError, match=r"unknown experiment argument 'smal'; valid: \[.*"
                                         r"'small'.*\]"):
        module.get_config("smal")
    with pytest.raises(ValueError, match=r"unknown experiment argument 'stpes'"):
        module.get_config("small,stpes=3")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_small_variant_says_it_is_a_plumbing_check(name):
    from espo_jax import run_record

    small = load(name, "small")
    assert small.plumbing_check and not load(name).plumbing_check
    assert run_record.banner(load(name)) is None
    text = run_record.banner(small)
    model = (os.path.basename(small.model.hf_path) if name in PRETRAINED
             else f"{FAMILY_PRESETS.get(name, 'tiny')}` (random weights)")
    assert text.startswith(f"plumbing check (`:small`), model `{model}"), text
    assert f"{small.train.steps} RL steps of {small.rollout.prompts_per_step} prompts x " \
        f"{small.zve.n_samples} samples, {small.eval.num_prompts} held-out prompts" in text
    assert "every stage runs end to end" in text and "accuracy is not expected to move" in text
    # The tiny random models: accuracy 0 and every group zero-variance, said in advance.
    assert ("zero-variance fraction 1 at every step are expected" in text) == (
        name not in PRETRAINED)


@pytest.mark.parametrize("name", sorted(set(REAL_SCALE) & set(EXPERIMENTS)))
def test_real_scale_shapes_and_shardings_on_paper(name):
    config = load(name)
    config_validation.validate(config, n_devices=REAL_SCALE[name], check_paths=False)
    model_config = run_setup.preset_model_config(config)  # the model the experiment builds
    assert model_config.scan_layers  # its layers one scan each: shaped in seconds
    sizes = tuple(config.mesh[a] for a in mesh_rules.MESH_AXES)
    assert math.prod(sizes) == REAL_SCALE[name]
    mesh = AbstractMesh(sizes, mesh_rules.MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    sharding.validate_divisibility(model_config, mesh)
    shapes = jax.eval_shape(lambda: init_params(model_config, jax.random.key(0)))
    shardings = sharding.param_shardings(model_config, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(shapes))
    assert n_params > 1e9
    for shape, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        s.shard_shape(shape.shape)  # raises if a dimension does not divide its mesh axes


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(EXPERIMENTS) - PRETRAINED))
def test_small_variant_runs_two_rl_steps(name, tmp_path_factory):
    config = load(name, "small")
    config.buffer.keep_consumed = name == "arith_espo"  # for `buffer inspect` (below)
    config_validation.validate(config, n_devices=jax.device_count())
    workdir = str(tmp_path_factory.mktemp(name))
    summary = loop.run_sync(config, workdir)
    with open(os.path.join(workdir, "summary.json")) as f:
        on_disk = json.load(f)
    for key in SUMMARY_KEYS:
        assert key in on_disk, key
    assert on_disk["steps"] == summary["steps"] == 2 and on_disk["skipped_updates"] == 0
    assert on_disk["wall_seconds"] > 0
    records = plot.read_records(os.path.join(workdir, "metrics.jsonl"))
    assert all(math.isfinite(v) for r in records for v in r.values()
               if isinstance(v, float)), "a non-finite metric"
    rl_steps = [r["step"] for r in records if r["phase"] == "rl" and "train/loss" in r]
    assert rl_steps == [1, 2]
    # The summary's accuracies are the held-out evaluations before and after RL (eval.every is
    # 0 in the small variant: no other), each the share of eval.num_prompts greedy answers.
    evals = [r for r in records if r["phase"] == "eval" and "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert (on_disk["warmstart_accuracy"] == on_disk["warmstart"]["eval/accuracy"]
            == evals[0]["eval/accuracy"])
    assert on_disk["final_accuracy"] == on_disk["final"]["eval/accuracy"] == evals[1][
        "eval/accuracy"]
    n_eval = config.eval.num_prompts
    for acc in (on_disk["warmstart_accuracy"], on_disk["final_accuracy"]):
        assert abs(acc * n_eval - round(acc * n_eval)) < 1e-6, (acc, n_eval)
    # Token accounting: the offline pass-rate pass (stage 0, no gradient: no signal) plus each
    # step's rollouts; a step samples at least prompts_per_step x n_samples responses of at
    # most max_new_tokens tokens, and trains on what it did not drop.
    rl = [r for r in records if r["phase"] == "rl" and "train/loss" in r]
    offline = sum(r.get("zve/offline_tokens", 0.0) for r in records if r["phase"] == "rl")
    assert on_disk["generated_tokens"] == offline + sum(r["zve/tokens_generated"] for r in rl)
    no_signal = sum(r["zve/no_signal_tokens"] for r in rl)
    assert on_disk["no_signal_token_frac_with_offline"] == pytest.approx(
        (offline + no_signal) / on_disk["generated_tokens"])
    assert on_disk["no_signal_token_frac"] == pytest.approx(
        no_signal / (on_disk["generated_tokens"] - offline))
    per_step = config.rollout.prompts_per_step * config.zve.n_samples
    for r in rl:
        n, tokens = r["zve/rollouts_generated"], r["zve/tokens_generated"]
        assert n >= per_step and 0 < tokens <= n * config.rollout.max_new_tokens, r
        # The trained batch: prompts_per_step groups of n_samples (the small variant's adaptive
        # sampling is pinned to it); outcomes are binary, so accuracy counts right answers.
        assert r["zve/batch_groups"] == config.rollout.prompts_per_step
        assert r["pg/num_tokens"] == r["zve/trained_tokens"] == pytest.approx(
            per_step * r["rollout/response_len_mean"])
        assert r["rollout/accuracy"] * per_step == round(r["rollout/accuracy"] * per_step)
    # FP8 engine vs fp32 learner, mean |logp| gap per token: |dlogp| <= 2 max |dlogit|, and the
    # tiny model's FP8 logits err by at most ~0.024 (tests/models/test_quant.py), so the mean
    # is below 0.05; measured 0.0037 (its typical size: 0.8 x 3.6% x the logits' RMS 0.15).
    assert 0.0 < on_disk["mean_abs_logp_mismatch"] < 0.05
    phases = {r["phase"] for r in records}
    assert {"eval", "rl"} <= phases
    assert ("warmstart" in phases) == (config.warmstart.steps > 0)
    rl = [r for r in records if r["phase"] == "rl" and "train/loss" in r]
    for key in ("mismatch/logp_abs_mean", "moe/routing_flip_rate", "zve/zero_variance_frac_before",
                "entropy/mean", "train/grad_norm"):
        assert all(r[key] is not None for r in rl), key
    for r in rl:  # the step's time splits into rollout (generate + score) and learner update
        assert r["time/rollout_s"] > 0 and r["time/update_s"] > 0
        assert r["time/rollout_s"] + r["time/update_s"] == pytest.approx(r["time/step_s"])
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
    assert os.listdir(os.path.join(workdir, "tensorboard"))
    if name == "arith_espo":  # `python -m espo_jax.plot` on a finished run (here, not in a
        # test of its own: under pytest-xdist that one could land in another worker and skip)
        written = plot.plot_run(workdir)
        names = {os.path.basename(p) for p in written}
        assert {"accuracy.png", "zero_variance.png", "mismatch.png", "entropy.png"} <= names
        for path in written:
            with open(path, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        _check_samples_and_buffer_inspect(config, workdir)


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_samples_and_buffer_inspect(config, workdir):
    """After a 2-step run: samples.jsonl and TensorBoard's text tab hold the first
    `log.samples_per_step` groups of each step as text with rewards, outcomes and advantages;
    `buffer inspect` (shards kept: buffer.keep_consumed) reports what the learner consumed,
    the staleness at consumption, and shows a group's text as samples.jsonl has it."""
    from tensorboard.backend.event_processing import event_accumulator

    from espo_jax.buffer.text import OUTCOMES

    k, n = config.log.samples_per_step, config.zve.n_samples
    rows = _jsonl(os.path.join(workdir, "samples.jsonl"))
    assert [(r["step"], r["group"], r["sample"]) for r in rows] == [
        (step, g, j) for step in (1, 2) for g in range(k) for j in range(n)]
    for r in rows:
        assert r["outcome"] in OUTCOMES and isinstance(r["reward"], float), r
        assert r["prompt"] and r["prompt_id"].endswith(r["prompt"]), r  # arith ids end so
        assert len(r["completion"]) <= r["length"] <= config.rollout.max_new_tokens, r
        assert (r["advantage"] is None) == (r["train_reward"] is None) == (not r["kept"]), r
    groups = {}
    for r in rows:
        groups.setdefault((r["step"], r["group"]), []).append(r)
    for group in groups.values():  # group-relative advantages are centred in each group
        if group[0]["kept"]:
            assert abs(sum(r["advantage"] for r in group)) < 1e-4, group
    events = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"),
                                                size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/rl")
    assert [e.step for e in texts] == [1, 2]
    for e, step in zip(texts, (1, 2), strict=True):
        table = e.tensor_proto.string_val[0].decode()
        assert len(table.splitlines()) == 2 + k * n
        assert f"| 0 | {groups[(step, 0)][0]['prompt_id']} |" in table

    # The single process reads each step's groups at the version that generated them.
    consumed = _jsonl(os.path.join(workdir, "consumed.jsonl"))
    assert [c["step"] for c in consumed] == [0, 1, 2]  # 0: the offline pass-rate pass
    total = sum(len(c["groups"]) for c in consumed)
    inspect = [sys.executable, "-m", "espo_jax.buffer", "inspect", os.path.join(workdir, "buffer")]
    out = subprocess.run(inspect, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"consumed: the learner read {total} groups in RL steps 0..2" in out.stdout
    assert f"--config.buffer.keep_consumed=True: {total} of the {total} groups here" in out.stdout
    assert ("staleness at consumption (the learner's policy version when it read a group minus "
            f"the version that generated it; train.max_staleness bounds it): 0: {total} groups"
            ) in out.stdout
    # Step 2's first group, the last step's groups being the buffer's last ones.
    first = total - len(consumed[-1]["groups"])
    out = subprocess.run([*inspect, f"--show_group={first}"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    sample = groups[(2, 0)]
    assert f"prompt {sample[0]['prompt_id']!r}, policy version 1" in out.stdout
    for r in sample:
        reward = f"{r['reward']:.4g}"
        assert (f"response {r['sample']}: {r['outcome']}, reward {reward}, {r['length']} tokens"
                ) in out.stdout
        assert r["completion"] in out.stdout
    assert out.stdout.count(sample[0]["prompt"]) >= 1


@pytest.mark.slow
def test_warm_start_only_run_with_a_time_budget(tmp_path):
    # train.steps = 0: supervised warm start only (the "same wall time on more warm-start
    # steps" comparison); a 1 us budget stops it after its first step, evaluated.
    config = load("arith_espo", "small")
    config.train.steps, config.warmstart.steps, config.warmstart.max_seconds = 0, 50, 1e-6
    config_validation.validate(config, n_devices=jax.device_count())
    summary = loop.run_sync(config, str(tmp_path))
    assert summary["steps"] == 0 and summary["generated_tokens"] == 0  # no offline pass either
    assert summary["warmstart_steps"] == 1 and summary["warmstart_seconds"] > 0
    records = plot.read_records(os.path.join(str(tmp_path), "metrics.jsonl"))
    warm = [r for r in records if r["phase"] == "warmstart"]
    assert [r["step"] for r in warm] == [1] and warm[0]["eval/accuracy"] is not None
    assert summary["final_accuracy"] == summary["warmstart_accuracy"]  # the same parameters




@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3"])
def test_family_small_variant_in_the_worker_layout(name, tmp_path):
    """The DeepSeek-V3 small variant through the main job in the worker layout
    (`train.loop=async`: spawned rollout workers, the buffer, weight publication), router
    replay R3 on: 2 RL steps, every update applied, the rollouts' log-probs of a step read on
    policy within 0.01 of the learner's, as in the single-process runs. One family: the
    workers run the engine and the learner the step every family runs in the single process
    (`test_small_variant_runs_two_rl_steps`); DeepSeek-V3's MLA caches and sigmoid router are
    the ones furthest from the default experiment's (the GLM-4.5 and Qwen3.5 runs here took
    100 and 167 s of a cold suite)."""
    config = load(name, "small")
    assert (config.train.replay, config.model.preset) == ("r3", FAMILY_PRESETS[name])
    workdir = str(tmp_path / name)
    env = one_device_env()  # one CPU device each
    subprocess.run([sys.executable, "-m", "espo_jax.main", "--config",
                    f"experiments/{name}.py:small", "--config.train.loop=async",
                    "--workdir", workdir], cwd=REPO, env=env, check=True, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["skipped_updates"] == 0
    records = plot.read_records(os.path.join(workdir, "metrics.jsonl"))
    rl = [r for r in records if r["phase"] == "rl" and "train/loss" in r]
    assert [r["step"] for r in rl] == [1, 2]
    assert rl[0]["async/staleness_max"] == 0  # step 1 reads the initial policy's groups
    for r in rl:  # routing recorded by the workers' engines, replayed by the learner
        assert r["moe/routing_flip_rate"] is not None and math.isfinite(r["train/loss"])
        if r["async/staleness_max"] == 0:  # on-policy: the FP8 engine's numerics alone, as in
            assert 0.0 < r["mismatch/logp_abs_mean"] < 0.01  # the single process (~0.003)
    # A stale group's mismatch also holds the updates since it was sampled (espo_jax.mismatch).
    assert summary["mean_abs_logp_mismatch"] == pytest.approx(
        np.mean([r["mismatch/logp_abs_mean"] for r in rl]))
    assert os.listdir(os.path.join(workdir, "workers"))
    # Started again, finished: it says so, as the single process does (tests/test_main.py),
    # and neither evaluates nor starts workers; summary.json stays byte for byte.
    before = open(os.path.join(workdir, "summary.json"), "rb").read()
    again = subprocess.run([sys.executable, "-m", "espo_jax.main", "--config",
                            f"experiments/{name}.py:small", "--config.train.loop=async",
                            "--workdir", workdir], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.startswith(f"{workdir}: finished (2 RL steps done), nothing to run")
    assert open(os.path.join(workdir, "summary.json"), "rb").read() == before
