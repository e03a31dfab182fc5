"""`config.imports`: modules imported before validation, by the main job and every rollout
worker, so a loss registered in them trains from the command line (experiments/my_loss.py)."""

import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
from helpers.env import one_device_env

from espo_jax import config_imports, config_validation, configs
from espo_jax.rl import losses
from espo_jax.train import async_loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_MODULE = '''
import jax.numpy as jnp
from espo_jax.rl import losses


@losses.register("{name}", aggregation="token_mean")
def surrogate(logp, old_logp, advantages, mask, config, *, entropy=None):
    ratio = jnp.exp(jnp.where(mask > 0, logp - old_logp, 0.0))
    return losses.Surrogate(objective=ratio * advantages * mask, ratio=ratio,
                            lower=0 * ratio, upper=0 * ratio + 9, group_weights=None, metrics={{}})
'''


@pytest.fixture
def clean_imports():
    """Whatever a test imports or registers is gone after it (the registry is global)."""
    modules, path, registered = set(sys.modules), list(sys.path), set(losses.LOSSES)
    yield
    for name in set(sys.modules) - modules:
        del sys.modules[name]
    sys.path[:] = path
    for name in set(losses.LOSSES) - registered:
        del losses.LOSSES[name]


def _small(**loss):
    c = configs.apply_small(configs.default_config())
    c.loss.vocab_size = 128
    for key, value in loss.items():
        c.loss[key] = value
    return c


def test_names_from_a_string_or_a_tuple():
    assert config_imports.module_names(" a, b.c ,,") == ["a", "b.c"]
    assert config_imports.module_names(("a", "pkg/m.py")) == ["a", "pkg/m.py"]
    assert config_imports.module_names("") == []
    with pytest.raises(ValueError, match="comma-separated string or a tuple"):
        config_imports.module_names(3)


def test_modules_from_the_working_directory_a_path_and_experiments(
        tmp_path, monkeypatch, clean_imports):
    (tmp_path / "cwd_loss_mod.py").write_text(LOSS_MODULE.format(name="cwd_loss"))
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "path_loss_mod.py").write_text(LOSS_MODULE.format(name="path_loss"))
    monkeypatch.chdir(tmp_path)
    # As in a fresh process: an earlier test in this one (a my_loss run) may have left
    # experiments/ on sys.path and my_loss imported (clean_imports restores both afterwards).
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != configs.EXPERIMENTS_DIR])
    monkeypatch.delitem(sys.modules, "my_loss", raising=False)
    c = _small(name="cwd_loss")
    with pytest.raises(ValueError, match="loss 'cwd_loss' is not registered.*--config.imports"):
        config_validation.validate(c)  # without the import
    c.imports = "cwd_loss_mod, elsewhere/path_loss_mod.py, my_loss"  # my_loss: experiments/
    config_validation.validate(c)
    assert {"cwd_loss", "path_loss", "reinforce"} <= set(losses.LOSSES)
    assert losses.LOSSES["reinforce"].fn is sys.modules["my_loss"].reinforce
    assert sys.path[-2:] == [str(tmp_path), configs.EXPERIMENTS_DIR]  # after the installed ones
    config_validation.validate(c)  # validated again: imported once, registered once
    c.imports = "no_such_loss_mod,elsewhere/missing.py"
    with pytest.raises(ValueError) as e:
        config_validation.validate(c)
    assert (f"config.imports: no module 'no_such_loss_mod' on sys.path, in the working "
            f"directory {tmp_path} or in {configs.EXPERIMENTS_DIR}") in str(e.value)


def test_a_spawned_rollout_worker_imports_them(tmp_path):
    """The learner's worker processes get the config as JSON and build their run without
    validating it: they import `config.imports` themselves (here a module that leaves a file,
    then the worker stops at its unimportable task)."""
    marker = tmp_path / "imported_in"
    (tmp_path / "marker_mod.py").write_text(
        f"import os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n")
    c = _small()
    c.imports = str(tmp_path / "marker_mod.py")
    c.task = "no_such_task_pkg.tasks:make"
    p = mp.get_context("spawn").Process(target=async_loop._worker_main,
                                        args=(c.to_json(), str(tmp_path / "run"), 0))
    p.start()
    p.join(120)
    assert p.exitcode not in (0, None)  # stopped at the task, after the import
    assert marker.read_text() == str(p.pid)


@pytest.mark.slow
def test_my_loss_trains_from_the_command_line(tmp_path):
    """experiments/my_loss.py's command (its docstring), `:small`: 2 RL steps with REINFORCE;
    the same command without `--config.imports` stops before any work, saying how."""
    command = [sys.executable, "-m", "espo_jax.main", "--config", "experiments/arith_espo.py:small",
               "--config.loss.name=reinforce"]
    env = one_device_env()
    refused = subprocess.run(command + ["--workdir", str(tmp_path / "refused")], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert "loss 'reinforce' is not registered" in refused.stderr
    assert "--config.imports=MODULE" in refused.stderr
    assert not os.path.exists(tmp_path / "refused" / "checkpoints")
    workdir = tmp_path / "run"
    subprocess.run(command + ["--config.imports=my_loss", "--workdir", str(workdir)], cwd=REPO,
                   env=env, check=True, timeout=900, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(workdir / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["skipped_updates"] == 0
    with open(workdir / "metrics.jsonl") as f:
        rl = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "pg/loss" in r]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:  # no clip: bounds 0 and inf
        assert r["pg/clipfrac_low"] == r["pg/clipfrac_high"] == 0.0
