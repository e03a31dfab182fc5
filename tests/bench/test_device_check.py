"""launch/device_check.sh --dry_run: every section of the accelerator check runs on the CPU at
tiny sizes, through the launcher, the `bench` runner and one process per section; and the
check's own arithmetic (version gate, card detection) by hand."""

import json
import os
import subprocess

import jax
import pytest
from helpers.env import one_device_env

from espo_jax.bench import device_check, device_sections
from espo_jax.models.flops import param_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITECUSTOMIZE = """
import importlib.abc, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(name + ": not in the accelerator image")

sys.meta_path.insert(0, Refuse())
"""


@pytest.mark.parametrize("version, ok", [("0.10.2", True), ("0.11.0", True), ("0.11.3", True),
                                         ("0.9.2", False), ("0.12.0", False), ("1.0.0", False)])
def test_jax_version_gate(version, ok):
    error = device_check.jax_version_error(version)
    assert (error is None) == ok
    if not ok:
        assert f"JAX {version} is not supported" in error and ">= 0.10 and < 0.12" in error


def test_nominal_peaks_by_device_name():
    h100 = device_check.nominal_peaks("NVIDIA H100 80GB HBM3")
    h200 = device_check.nominal_peaks("NVIDIA H200")
    assert (h100["card"], h100["bf16_flops"], h100["hbm_bytes_per_s"]) == ("H100", 989e12, 3.35e12)
    assert (h200["card"], h200["hbm_bytes_per_s"]) == ("H200", 4.8e12)
    assert device_check.nominal_peaks("cpu") is None


@pytest.mark.slow
def test_dry_run_every_section(tmp_path):
    out = tmp_path / "device_check.json"
    # Every process of the check refuses what the accelerator image lacks (a sitecustomize
    # first on the path; pytest's own hypothesis plugin is loaded here, not there).
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(SITECUSTOMIZE.format(
        blocked=[m for m in device_check.NOT_IN_IMAGE if m != "hypothesis"]))
    # one CPU device, as on the accelerator (not conftest's eight)
    env = one_device_env(PYTHONPATH=f"{block}:{ROOT}", DEVICE_SITE=str(tmp_path / "site"))
    proc = subprocess.run([os.path.join(ROOT, "launch", "device_check.sh"), "--dry_run",
                           str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| section | status | seconds | error |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["device"]["jax"] == jax.__version__
    s = result["sections"]
    assert list(s) == list(device_check.SECTIONS)
    assert {k: v["status"] for k, v in s.items()} == dict.fromkeys(s, "ok"), s
    assert s["matmul"]["figures"]["bf16_matmul_flops"] > 0

    rows = {(r["dispatch"], r["attention_impl"]): r
            for r in s["learner_qwen3_moe"]["figures"]["variants"]}
    ragged = rows[("ragged", "xla")]
    cfg = device_sections.model_config("qwen3_moe", dry_run=True)
    groups, _ = device_sections.synthetic_groups(cfg, 2, 2, 8, 8)
    responses = sum(len(r.tokens) for g in groups for r in g.responses)
    sequences = sum(len(g.prompt_tokens) + len(r.tokens) for g in groups for r in g.responses)
    # packed rows hold each response, and each prompt at most once per response
    assert responses < ragged["tokens"] <= sequences
    assert ragged["tokens_per_s"] == pytest.approx(ragged["tokens"] / ragged["update_s"])
    assert "cudnn" in rows[("ragged", "cudnn")]["error"].lower()  # recorded, the rest ran on
    deepseek = s["learner_deepseek"]["figures"]["variants"]
    assert all(r["tokens_per_s"] > 0 for r in deepseek)

    engine = {r["precision"]: r for r in s["engine"]["figures"]["rows"]}
    # fp32 engine weights: 4 bytes per parameter but the embedding table; bf16 half of that;
    # E4M3 (1 byte, with float32 scales) less again
    assert engine["fp32"]["weight_bytes"] == 4 * (param_count(cfg) - cfg.vocab_size * cfg.d_model)
    assert engine["bf16"]["weight_bytes"] * 2 == engine["fp32"]["weight_bytes"]
    assert engine["fp8"]["weight_bytes"] < engine["bf16"]["weight_bytes"]
    # the fp32 KV cache: layers x slots x (prompt 4 + 8 new) x kv heads x head dim x (k, v) x 4
    assert engine["fp32"]["kv_bytes"] == 2 * 4 * 12 * 2 * 16 * 2 * 4
    assert all(r["tokens_per_s"] > 0 and r["hbm_bound_frac"] is None for r in engine.values())

    mismatch = s["mismatch"]["figures"]
    assert mismatch["plain"]["mismatch/tokens"] > 0
    assert mismatch["replay"]["mismatch/tokens"] == mismatch["plain"]["mismatch/tokens"]
    assert s["pytest"]["figures"]["passed"]


def test_refuses_a_cpu_without_dry_run(monkeypatch):
    if jax.default_backend() != "cpu":
        pytest.skip("an accelerator is present")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")  # restored after: run() sets it
    with pytest.raises(SystemExit, match="no accelerator"):
        device_check.run()
