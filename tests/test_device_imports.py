"""The learner, the engine, the buffer and the models import without TensorFlow, TFDS and clu
(only data preparation and the TensorBoard writer load them), and the accelerator check needs
nothing beyond a bare JAX image and the wheels launch/device_wheels.sh carries.

Each check runs in a fresh interpreter whose `sys.meta_path` starts with a finder that refuses
the blocked packages and records every attempt: an import wrapped in try/except would pass a
plain "does it import" test, so an attempt at all fails it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from espo_jax.bench.device_check import NOT_IN_IMAGE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("espo_jax.train.learner", "espo_jax.train.step", "espo_jax.rollout.engine",
        "espo_jax.rollout.mismatch", "espo_jax.buffer", "espo_jax.models", "espo_jax.mismatch")
TF = ("tensorflow", "tensorflow_datasets", "clu", "tensorboard")
CHECK = CORE + ("espo_jax.bench.device_check", "espo_jax.bench.__main__", "espo_jax.configs",
                "espo_jax.rl.loss_config", "espo_jax.sharding", "espo_jax.train.state")

PROBE = textwrap.dedent("""
    import importlib, importlib.abc, json, sys
    blocked, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    attempts = []

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in blocked:
                attempts.append(name)
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Refuse())
    errors = {}
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:
            errors[m] = f"{type(e).__name__}: {e}"
    print(json.dumps({"attempts": sorted(set(attempts)), "errors": errors}))
""")


def _probe(blocked, modules):
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(blocked), json.dumps(modules)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("blocked, modules", [(TF, CORE), (NOT_IN_IMAGE, CHECK)],
                         ids=["core-without-tensorflow", "device-check-on-a-bare-image"])
def test_imports_without(blocked, modules):
    out = _probe(list(blocked), list(modules))
    assert out == {"attempts": [], "errors": {}}


def test_the_probe_sees_a_blocked_import():
    # numpy is imported by every module checked: blocked, the attempt and the error show
    out = _probe(["numpy"], ["espo_jax.mismatch"])
    assert "numpy" in out["attempts"]
    assert out["errors"]["espo_jax.mismatch"].startswith("ImportError")
