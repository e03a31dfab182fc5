"""Where a run starts from, found before any work: `checkpoint.init_from` given a run's WORKDIR
uses its only checkpoint directory (logged) or names the paths to give, and a checkpoint whose
parameters differ from the config's model is refused naming the first that differs."""

import functools
import logging
import os

import jax
import pytest

from espo_jax import configs, run_setup
from espo_jax.models import init_params
from espo_jax.train import checkpoint, loop
from espo_jax.train import state as state_lib
from espo_jax.train.checkpoint import Checkpointer


def _config(**model):
    c = configs.default_config()
    configs.apply_small(c)  # the tiny preset: d_model 64
    for key, value in model.items():
        c.model[key] = value
    return c


def _save(directory, config, step=0):
    """A train state of `config`'s model saved at `step` under `directory`."""
    params = jax.jit(functools.partial(init_params, run_setup.model_architecture(config)))(
        jax.random.key(0))
    tx = state_lib.make_optimizer(config.optim, total_steps=10)
    ckpt = Checkpointer(str(directory), async_save=False)
    ckpt.save(step, state_lib.create_train_state(params, tx, jax.random.key(1)), {"rl_step": step})
    ckpt.close()
    return params


def test_init_from_a_workdir_uses_its_only_checkpoint_directory_or_names_both(tmp_path, caplog):
    run = tmp_path / "run"
    c = _config()
    with pytest.raises(ValueError, match=r"init_from='.*/run' holds no checkpoint, nor does a "
                                         r"warmstart/ or checkpoints/ under it"):
        checkpoint.resolve_init_from(str(run))
    assert not run.exists()  # looking created nothing
    _save(run / "warmstart", c)  # a warm-start-only run (train.steps=0)
    with caplog.at_level(logging.INFO):
        assert checkpoint.resolve_init_from(str(run)) == str(run / "warmstart")
    assert f"checkpoint.init_from={run} is a run's WORKDIR: starting from its warmstart/ " \
           "(step 0)" in caplog.text
    assert checkpoint.resolve_init_from(str(run / "warmstart")) == str(run / "warmstart")
    _save(run / "checkpoints", c, step=7)  # the same run after RL: which one is meant?
    with pytest.raises(ValueError) as raised:
        checkpoint.resolve_init_from(str(run))
    assert str(raised.value) == (
        f"config.checkpoint.init_from='{run}' is a run's WORKDIR, not a checkpoint directory: "
        f"give {run}/warmstart (its warm-started policy) or {run}/checkpoints (its latest RL "
        "checkpoint, step 7)")
    # The run's own checkpoints come first; init_from is resolved only when there are none.
    assert checkpoint.start_point(str(tmp_path / "new"), str(run / "checkpoints")) == (
        str(run / "checkpoints"), 7)
    assert checkpoint.start_point(str(run), "/nowhere") == (str(run / "checkpoints"), 7)
    assert checkpoint.start_point(str(tmp_path / "new"), "") is None


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_parameter(tmp_path):
    _save(tmp_path / "ckpt", _config())  # tiny: d_model 64
    wider = _config(preset="small")
    small, tiny = run_setup.abstract_params(wider), run_setup.abstract_params(_config())
    want = small["embed"]["embedding"].shape
    assert want != tiny["embed"]["embedding"].shape
    message = (f"checkpoint {tmp_path}/ckpt/0 does not fit the config's model: parameter "
               f"embed/embedding has shape {tiny['embed']['embedding'].shape} in the checkpoint, "
               f"{want} in the config")
    with pytest.raises(ValueError) as raised:
        checkpoint.check_params(str(tmp_path / "ckpt"), 0, small)
    assert str(raised.value) == message
    checkpoint.check_params(str(tmp_path / "ckpt"), 0, tiny)  # the same model passes
    # Restoring goes through the same check instead of failing inside orbax.
    tx = state_lib.make_optimizer(wider.optim, total_steps=10)
    template = state_lib.create_train_state(
        jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), small), tx, jax.random.key(0))
    with pytest.raises(ValueError, match="parameter embed/embedding has shape"):
        Checkpointer(str(tmp_path / "ckpt"), async_save=False).restore(template)
    missing = {k: v for k, v in tiny.items() if k != "final_norm"}
    with pytest.raises(ValueError, match="parameters the config's model lacks, first "
                                         r"final_norm/scale \(shape \(64,\)\)"):
        checkpoint.check_params(str(tmp_path / "ckpt"), 0, missing)


def test_a_run_refuses_its_start_before_any_data_preparation(tmp_path, monkeypatch):
    """`init_from` naming a run's WORKDIR of another architecture stops the run before the
    task's prompts are prepared (run_setup.build) or anything is compiled."""
    _save(tmp_path / "other" / "warmstart", _config())  # tiny
    config = _config(preset="small")
    config.checkpoint.init_from = str(tmp_path / "other")

    def build(*args):
        raise AssertionError("prompts prepared before the start checkpoint was checked")

    monkeypatch.setattr(run_setup, "build", build)
    with pytest.raises(ValueError, match=r"checkpoint .*/other/warmstart/0 does not fit the "
                                         r"config's model: parameter embed/embedding"):
        loop.SyncRun(config, str(tmp_path / "work"))
    assert not os.path.exists(tmp_path / "work" / "data")
