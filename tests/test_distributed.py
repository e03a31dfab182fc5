"""Multi-host learner: topology resolution, and a real two-process `jax.distributed` run on CPU.

The two-process run (`tests/helpers/distributed_proc.py`): 2 processes with 4 fake CPU devices each,
joined through a coordinator on a free localhost port (CPU collectives: gloo, the JAX 0.10
default), one mesh data=2 x expert=4 over the 8 global devices; 2 learner updates on fixed
rollout groups; a multi-host orbax checkpoint saved and restored. The reference is one process
with 8 fake devices and the same mesh, started at the same time.
"""

import json
import os
import subprocess
import sys

import numpy as np
import portpicker
import pytest

from espo_jax import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROC = os.path.join(ROOT, "tests", "helpers", "distributed_proc.py")


# ---- resolve: where the topology comes from ----------------------------------------------------
def test_single_process_by_default():
    spec = distributed.resolve(env={})
    assert (spec.mode, spec.source) == ("single", "default")


def test_environment_gives_explicit_spec():
    env = {"ESPO_COORDINATOR": "10.0.0.1:1234", "ESPO_NUM_PROCESSES": "4",
           "ESPO_PROCESS_ID": "3", "ESPO_LOCAL_DEVICE_IDS": "0,1"}
    spec = distributed.resolve(env=env)
    assert spec == distributed.DistributedSpec("explicit", "ESPO_* environment",
                                               "10.0.0.1:1234", 4, 3, (0, 1))


def test_arguments_override_environment():
    env = {"ESPO_COORDINATOR": "a:1", "ESPO_NUM_PROCESSES": "4", "ESPO_PROCESS_ID": "3"}
    spec = distributed.resolve("b:2", 2, 0, env=env)
    assert (spec.mode, spec.coordinator_address, spec.num_processes, spec.process_id) == (
        "explicit", "b:2", 2, 0)
    # One process asked for explicitly: nothing to initialise, whatever else is set.
    assert distributed.resolve(num_processes=1, env=env).mode == "single"


def test_auto_detection_for_tpu_and_slurm():
    assert distributed.resolve(env={"ESPO_DISTRIBUTED": "auto"}).mode == "auto"
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    spec = distributed.resolve(env=slurm)
    assert (spec.mode, spec.source) == ("auto", "Slurm (2 tasks)")
    # One Slurm task, or ESPO_DISTRIBUTED=off: a single process.
    assert distributed.resolve(env={**slurm, "SLURM_NTASKS": "1"}).mode == "single"
    assert distributed.resolve(env={"ESPO_DISTRIBUTED": "off"}).mode == "single"
    # ESPO_* variables win over Slurm's.
    spec = distributed.resolve(env={**slurm, "ESPO_NUM_PROCESSES": "1"})
    assert spec.mode == "single"


@pytest.mark.parametrize("env, match", [
    ({"ESPO_COORDINATOR": "h:1", "ESPO_PROCESS_ID": "0"}, "ESPO_NUM_PROCESSES is required"),
    ({"ESPO_NUM_PROCESSES": "2", "ESPO_PROCESS_ID": "0"}, "needs ESPO_COORDINATOR"),
    ({"ESPO_NUM_PROCESSES": "2", "ESPO_COORDINATOR": "h:1"}, "needs ESPO_PROCESS_ID"),
    ({"ESPO_NUM_PROCESSES": "2", "ESPO_COORDINATOR": "h:1", "ESPO_PROCESS_ID": "2"},
     r"ESPO_PROCESS_ID=2 is not in \[0, 2\)"),
    ({"ESPO_NUM_PROCESSES": "two"}, "ESPO_NUM_PROCESSES must be an integer"),
    ({"ESPO_NUM_PROCESSES": "2", "ESPO_COORDINATOR": "h", "ESPO_PROCESS_ID": "0"},
     "must be host:port"),
    ({"ESPO_DISTRIBUTED": "maybe"}, "ESPO_DISTRIBUTED='maybe'"),
])
def test_bad_settings_name_the_problem(env, match):
    with pytest.raises(ValueError, match=match):
        distributed.resolve(env=env)


def test_single_process_initialize_is_a_no_op():
    spec = distributed.initialize(num_processes=1)
    assert spec.mode == "single"
    import jax

    assert (jax.process_count(), jax.process_index(), distributed.is_primary()) == (1, 0, True)


# ---- the two-process run ------------------------------------------------------------------------
def _start(tmp, name: str, n_devices: int, extra_env: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ESPO_", "SLURM_"))}
    env.update(extra_env, PYTHONPATH=ROOT,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}")
    log = open(os.path.join(tmp, f"{name}.log"), "w")  # noqa: SIM115
    run = "two" if name.startswith("p") else "one"  # the processes of a run share a workdir
    return subprocess.Popen([sys.executable, PROC, os.path.join(tmp, f"work_{run}"),
                             os.path.join(tmp, run)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("distributed"))
    coordinator = f"localhost:{portpicker.pick_unused_port()}"
    procs = {
        f"p{i}": _start(tmp, f"p{i}", 4, {"ESPO_COORDINATOR": coordinator,
                                          "ESPO_NUM_PROCESSES": "2", "ESPO_PROCESS_ID": str(i)})
        for i in range(2)
    }
    procs["single"] = _start(tmp, "single", 8, {})
    try:
        codes = {name: p.wait(timeout=300) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for name, code in codes.items():
        if code != 0:
            with open(os.path.join(tmp, f"{name}.log")) as f:
                pytest.fail(f"process {name} exited {code}:\n{f.read()[-4000:]}")

    def info(prefix, i):
        with open(os.path.join(tmp, f"{prefix}.{i}.json")) as f:
            return json.load(f)

    return {
        "two": [info("two", 0), info("two", 1)],
        "one": info("one", 0),
        "two_params": dict(np.load(os.path.join(tmp, "two.npz"))),
        "one_params": dict(np.load(os.path.join(tmp, "one.npz"))),
    }


def test_two_processes_form_one_mesh(runs):
    p0, p1 = runs["two"]
    assert (p0["mode"], p0["process_count"], p0["local_devices"], p0["global_devices"]) == (
        "explicit", 2, 4, 8)
    assert (p0["is_primary"], p1["is_primary"]) == (True, False)
    assert runs["one"]["mode"] == "single" and runs["one"]["global_devices"] == 8
    # 16 rows (4 prompts x 4 samples) over data=2: each process's 4 devices are one data
    # index (the expert axis, 4, spans them), so process i feeds rows [8i, 8i + 8).
    assert (p0["rows"], p1["rows"], runs["one"]["rows"]) == ([0, 8], [8, 16], [0, 16])
    assert p0["put_batch_equal"] and p1["put_batch_equal"] and runs["one"]["put_batch_equal"]
    # Tiny preset: 8 experts over expert=4 -> 2 per device; d_model 64, d_expert 32 whole.
    assert p0["expert_shard_shape"] == p1["expert_shard_shape"] == [2, 64, 32]


def test_process_zero_data_reaches_every_process(runs):
    for info in runs["two"] + [runs["one"]]:
        assert info["groups_equal"]  # 4 rollout groups as records
        assert info["bytes_equal"]  # 2500 bytes in 3 chunks of <= 1000
        assert info["put_global_equal"] and info["put_global_sharded"]


def test_two_step_training_matches_one_process(runs):
    two, one = runs["two_params"], runs["one_params"]
    assert sorted(two) == sorted(one) and len(two) > 10
    max_diff = max(float(np.max(np.abs(two[k] - one[k]))) for k in one)
    print(f"two-process vs one-process max |param diff| after 2 steps: {max_diff:.3g}")
    # Not bitwise: the dense weights are split over `expert` too, so their gradients are
    # reduce-scattered across the two processes (gloo) in another order than within one. Adam's
    # update is scale-free (lr x m / sqrt(v)), so a gradient's relative rounding difference
    # (gamma_n ~ 1e-5 here: n = 64 x 2 layers) moves a parameter by that fraction of lr per step;
    # elements whose gradient is near its own rounding can move further (the worst case, a sign
    # flip, is 2 lr), so the bound is 1e-4 of the 2 steps' lr-sized movement, not a worst case.
    assert max_diff <= 1e-4 * 2 * 1e-2
    # The comparison is not vacuous: training moved the parameters (lr 1e-2, Adam: ~1e-2 per
    # step on parameters with a gradient).
    assert runs["one"]["moved_from_init"] > 1e-3
    np.testing.assert_allclose(runs["two"][0]["losses"], runs["one"]["losses"], atol=1e-6)
    assert runs["two"][0]["losses"] == runs["two"][1]["losses"]


def test_multihost_checkpoint_round_trip(runs):
    for info in runs["two"] + [runs["one"]]:
        assert info["restore_max_diff"] == 0.0  # restored into zeros: values came from disk
        assert info["restored_moments_equal"]
        assert info["restored_step"] == 2  # two optimiser updates
        assert info["meta"] == {"rl_step": 2, "note": "two-process"}
