"""`python -m espo_jax.bench NAME [--quick] [--out F.json]`: absl's usage errors, each before a
benchmark starts (a benchmark's own flags belong to it alone)."""

import subprocess
import sys

import pytest

NAMES = "model, buffer, engine, zve, attention, peers, packing, profile, real"


@pytest.mark.parametrize("args, message", [
    ([], f"give one benchmark NAME, one of {NAMES}; got none"),
    (["nope"], f"give one benchmark NAME, one of {NAMES}; got nope"),
    (["model", "--budget=5"], "--budget: not a flag of the model benchmark"),
    (["real", "--programs=generate"], "--programs: not a flag of the real benchmark"),
    (["zve", "--init_from=/nonexistent/run"], "--init_from '/nonexistent/run' is not a directory"),
    (["model", "--bogus"], "Unknown command line flag 'bogus'"),
    (["model", "--quick=maybe"], "flag --quick=maybe"),
])
def test_usage_errors(args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "espo_jax.bench", *args, f"--out={tmp_path}/f"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


def test_zve_quick_runs_on_the_default_config(tmp_path):
    """`bench zve --quick` on experiments/arith_espo.py's config (its small variant), as
    shipped: every configuration runs, and its accounting adds up."""
    out = tmp_path / "zve.json"
    proc = subprocess.run([sys.executable, "-m", "espo_jax.bench", "zve", "--quick",
                           f"--out={out}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    figures = json.loads(out.read_text())
    configs = figures["configurations"]
    assert len(configs) == 8 and "plain GRPO" in configs
    for name, c in configs.items():
        assert c["stopped"] == "", name
        assert 0 <= c["zero_variance_groups"] <= c["groups"], name
        assert c["signal_groups"] <= c["trained_groups"] <= c["groups"], name
        assert c["wasted_tokens"] <= c["tokens"] + c["offline_tokens"], name
    # Plain GRPO trains on every group: those without contrast are the zero-variance ones.
    plain = configs["plain GRPO"]
    assert plain["signal_groups"] == plain["trained_groups"] - plain["zero_variance_groups"]


def test_packing_quick_same_loss_fewer_slots(tmp_path):
    out = tmp_path / "packing.json"
    proc = subprocess.run([sys.executable, "-m", "espo_jax.bench", "packing", "--quick",
                           f"--out={out}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    f = json.loads(out.read_text())
    assert f["packed"]["real_tokens"] == f["padded"]["real_tokens"]
    assert f["packed"]["token_slots"] < f["padded"]["token_slots"]
    assert abs(f["packed"]["loss"] - f["padded"]["loss"]) < 1e-5
    # Attention in 4 causal query blocks against one block: the same loss.
    assert abs(f["packed, attention in 4 causal blocks"]["loss"] - f["packed"]["loss"]) < 1e-5
    # Each prompt once for its 8 responses: fewer tokens computed, the same loss.
    shared = f["packed, shared prompts"]
    assert shared["real_tokens"] < f["packed"]["real_tokens"]
    assert abs(shared["loss"] - f["packed"]["loss"]) < 1e-5
    # The learner's update: its gradient parts, each with shared prompts, joined into the
    # whole batch's loss; every layout's FLOP/s counts its own computed tokens.
    learner = f["learner: shared prompts, 2 gradient threads"]
    assert learner["grad_threads"] == 2 and learner["real_tokens"] <= f["packed"]["real_tokens"]
    assert abs(learner["loss"] - f["packed"]["loss"]) < 1e-5
    for name in ("padded", "packed", "learner: shared prompts, 2 gradient threads"):
        assert 0 < f[name]["of_peak"] < 1
        assert f[name]["model_flops"] == pytest.approx(
            f[name]["of_peak"] * f[name]["update_s"] * f["peak_matmul_flops"])
