"""Exact resume: a main job killed with SIGKILL mid-RL and started again with the same command
ends with the same parameters, bit for bit, and the same logs as a run that was never
interrupted (sync loop, CPU, same seeds). Real subprocesses, real orbax checkpoints, real
buffer shards."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers.env import one_device_env

from espo_jax import sharding
from espo_jax.models.presets import get_preset
from espo_jax.train import state as state_lib
from espo_jax.train.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3  # killed once step 2 is logged: mid-RL, with a step still to go


def _command(workdir, code):
    return [sys.executable, "-m", "espo_jax.main", "--config",
            os.path.join(code, "experiments", "arith_espo.py:small"),
            "--workdir", str(workdir), f"--config.train.steps={STEPS}",
            "--config.checkpoint.every=1", "--config.checkpoint.keep=2",
            "--config.eval.pass_k=0",
            # A KL term to the warm start, large enough to steer the updates (no warm-up, lr
            # 1e-3): the resumed run must penalise against the same reference. The supervised
            # anchor too: it must draw the same worked solutions at the same updates.
            "--config.loss.kl_coef=1.0", "--config.optim.warmup_steps=0",
            "--config.optim.lr=1e-3", "--config.train.anchor_coef=1.0"]


def _snapshot(dest):
    """A copy of the package and experiments: the three runs execute the same code even if
    the working tree is edited while the test runs (minutes)."""
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("espo_jax", "experiments"):
        shutil.copytree(os.path.join(REPO, name), os.path.join(dest, name), ignore=ignore)
    return str(dest)


def _start(workdir, log_name, code, *extra):
    log = open(os.path.join(os.path.dirname(workdir), log_name), "w")  # noqa: SIM115
    # One CPU device (no fake devices from conftest), as the command runs outside the tests;
    # the snapshot first on the path (python -m puts the working directory first).
    env = one_device_env()
    return subprocess.Popen(_command(workdir, code) + list(extra), cwd=code, stdout=log,
                            stderr=subprocess.STDOUT, env=env), log


def _rl_steps_logged(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.endswith("\n")]
    return [r["step"] for r in lines if r["phase"] == "rl" and r["step"] > 0]


def _finish(proc, log, timeout=600):
    rc = proc.wait(timeout=timeout)
    log.close()
    with open(log.name) as f:
        text = f.read()
    assert rc == 0, text[-3000:]
    return text


def _restore(workdir, config, step=STEPS, latest=STEPS):
    """Checkpoint `step` of a run, restored into a train state of the run's structure."""
    model_config = get_preset(config.model.preset, dispatch=config.model.dispatch)
    mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[:1])
    params = sharding.init_sharded(model_config, mesh)
    template = state_lib.create_train_state(
        params, state_lib.make_optimizer(config.optim, config.train.steps), jax.random.key(0))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    assert ckpt.latest_step() == latest
    state, meta = ckpt.restore(template, step=step)
    ckpt.close()
    return jax.device_get((state.params, state.opt_state, state.step, state.skipped)), meta


def _load_experiment_config(code):
    spec = importlib.util.spec_from_file_location(
        "arith_espo", os.path.join(code, "experiments", "arith_espo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("small")
    config.train.steps = STEPS
    return config


@pytest.mark.slow
def test_sigkill_mid_rl_then_rerun_is_bitwise_equal_to_uninterrupted(tmp_path):
    killed_dir, clean_dir = tmp_path / "killed", tmp_path / "clean"
    code = _snapshot(tmp_path / "code")
    clean, clean_log = _start(clean_dir, "clean.log", code)  # in parallel: wall time, not CPU
    victim, victim_log = _start(killed_dir, "killed.log", code)
    deadline = time.time() + 600
    while 2 not in _rl_steps_logged(killed_dir):
        assert victim.poll() is None, "the run ended before it could be killed mid-RL"
        assert time.time() < deadline, "no RL step 2 within 600 s"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)  # mid-RL: step 2 logged, its checkpoint maybe not
    assert victim.wait(timeout=60) == -signal.SIGKILL
    victim_log.close()
    assert not (killed_dir / "summary.json").exists()
    assert max(_rl_steps_logged(killed_dir)) < STEPS

    resumed, resumed_log = _start(killed_dir, "resumed.log", code)
    resumed_text = _finish(resumed, resumed_log)
    assert "resuming from" in resumed_text  # it did not silently start over
    _finish(clean, clean_log)

    config = _load_experiment_config(code)
    (p1, o1, step1, skip1), meta1 = _restore(str(killed_dir), config)
    (p2, o2, step2, skip2), meta2 = _restore(str(clean_dir), config)
    leaves1, leaves2 = jax.tree.leaves((p1, o1)), jax.tree.leaves((p2, o2))
    assert len(leaves1) == len(leaves2) > 0
    for a, b in zip(leaves1, leaves2, strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise (NaN-free)
    assert int(step1) == int(step2) and int(skip1) == int(skip2)
    # Host-side state matches too: prompt scheduler, length predictor, token counters.
    for key in ("rl_step", "zve", "predictor", "generated_tokens", "no_signal_tokens",
                "offline_tokens", "mismatch_sum"):
        assert meta1[key] == meta2[key], key
    s1 = json.loads((killed_dir / "summary.json").read_text())
    s2 = json.loads((clean_dir / "summary.json").read_text())
    for key in ("final_accuracy", "steps", "generated_tokens", "no_signal_token_frac_with_offline",
                "mean_abs_logp_mismatch", "final"):
        assert s1[key] == s2[key], key
    # The logs too: each step's rows once, as the uninterrupted run wrote them (the rows the
    # killed run logged past its last checkpoint were dropped, the resumed run's kept).
    def rows(workdir, name):
        with open(os.path.join(workdir, name)) as f:
            return [json.loads(x) for x in f]

    m1, m2 = rows(killed_dir, "metrics.jsonl"), rows(clean_dir, "metrics.jsonl")
    assert [(r["phase"], r["step"]) for r in m1] == [(r["phase"], r["step"]) for r in m2]
    assert any(r["phase"] == "rl" and r["step"] == STEPS for r in m1)
    for r1, r2 in zip(m1, m2, strict=True):
        assert r1.keys() == r2.keys()
        for key in ("train/loss", "rollout/accuracy", "eval/accuracy", "sft/nll"):
            assert r1.get(key) == r2.get(key), (r1["phase"], r1["step"], key)
    assert rows(killed_dir, "samples.jsonl") == rows(clean_dir, "samples.jsonl")
    c1, c2 = rows(killed_dir, "consumed.jsonl"), rows(clean_dir, "consumed.jsonl")
    assert [(r["step"], r["groups"]) for r in c1] == [(r["step"], r["groups"]) for r in c2]
    # The last RL step did move the parameters (otherwise equality would prove little).
    (p_prev, _, _, _), _ = _restore(str(clean_dir), config, step=STEPS - 1)
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(p2), jax.tree.leaves(p_prev), strict=True))

    # A token budget equal to what the clean run had generated after step 2 (its offline pass
    # included) stops the same command after step 2, with step 2's parameters: the budget ends
    # RL at a spend without changing the steps before it (the schedule still spans STEPS).
    (p_two, _, _, _), meta_two = _restore(str(clean_dir), config, step=STEPS - 1)
    budget = meta_two["generated_tokens"] + meta_two["offline_tokens"]
    budget_dir = tmp_path / "budget"
    _finish(*_start(budget_dir, "budget.log", code, f"--config.train.max_tokens={budget}"))
    summary = json.loads((budget_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS - 1 and summary["generated_tokens"] == budget
    (p3, _, _, _), _ = _restore(str(budget_dir), config, step=STEPS - 1, latest=STEPS - 1)
    for a, b in zip(jax.tree.leaves(p3), jax.tree.leaves(p_two), strict=True):
        np.testing.assert_array_equal(a, b)
