"""`python -m espo_jax.bench NAME [--quick] [--out F.json]`: absl's usage errors, each before a
benchmark starts (a benchmark's own flags belong to it alone)."""

import json
import subprocess
import sys

import pytest

NAMES = ("model, buffer, engine, zve, attention, peers, packing, profile, device_check, "
         "linear_decode, real, mla_decode, aot, scan")


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


def _quick(name: str, tmp_path) -> dict:
    """The figures of `python -m espo_jax.bench NAME --quick`, which must succeed."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "espo_jax.bench", name, "--quick",
                           f"--out={out}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_zve_quick_runs_on_the_default_config(tmp_path):
    """`bench zve --quick` on experiments/arith_espo.py's config (its small variant), as
    shipped: every configuration runs, and its accounting adds up."""
    figures = _quick("zve", tmp_path)
    configs = figures["configurations"]
    assert len(configs) == 8 and "plain GRPO" in configs
    for name, c in configs.items():
        assert c["stopped"] == "", name
        assert 0 <= c["zero_variance_groups"] <= c["groups"], name
        assert c["signal_groups"] <= c["trained_groups"] <= c["groups"], name
        assert c["no_signal_tokens"] + c["offline_tokens"] <= c["tokens"], name
        assert c["trained_zero_adv_tokens"] <= c["trained_tokens"], name
    # Plain GRPO trains on every group: those without contrast are the zero-variance ones.
    plain = configs["plain GRPO"]
    assert plain["signal_groups"] == plain["trained_groups"] - plain["zero_variance_groups"]


def test_packing_quick_same_loss_fewer_slots(tmp_path):
    f = _quick("packing", tmp_path)
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


def test_scan_quick_program_size_does_not_grow_with_depth(tmp_path):
    """`bench scan --quick`: the looped program holds every layer (8 layers, more than 2x the
    instructions of 2), the scanned one holds one (the same size within its run's bookkeeping)."""
    f = _quick("scan", tmp_path)
    assert f["depths"] == [2, 8] and f["repeats"] == 1
    loop, scanned = f["layouts"]["loop"], f["layouts"]["scan"]
    assert loop["8"]["hlo_instructions"] > 2 * loop["2"]["hlo_instructions"]
    assert abs(scanned["8"]["hlo_instructions"] - scanned["2"]["hlo_instructions"]) < 100
    assert scanned["8"]["hlo_instructions"] < loop["8"]["hlo_instructions"]
    assert f["scan_vs_loop_at_depth"] == pytest.approx(
        loop["8"]["compile_s"] / scanned["8"]["compile_s"])


def test_linear_decode_quick(tmp_path):
    """`bench linear_decode --quick`: both mixers' decode steps run at both contexts; the
    linear layer's cache read per token is its conv windows and state whatever the context,
    the full layer's its keys and values of every cached token."""
    from espo_jax.models import get_preset

    f = _quick("linear_decode", tmp_path)
    c = get_preset(f["preset"])
    assert f["preset"] == "tiny_qwen35_moe" and len(f["load_avg_1m"]) == 2
    n = 4 if c.dtype == "float32" else 2  # bytes per cached number
    hk, dk = c.linear_n_key_heads, c.linear_key_head_dim
    hv, dv = c.linear_n_value_heads, c.linear_value_head_dim
    linear = (c.linear_conv_kernel - 1) * (2 * hk * dk + hv * dv) * n + 4 * hv * dk * dv
    assert [r["context"] for r in f["rows"]] == [64, 512]
    for r in f["rows"]:
        assert r["linear_cache_bytes_per_token"] == linear
        assert r["full_cache_bytes_per_token"] == r["context"] * 2 * c.n_kv_heads * c.head_dim * n
        for kind in ("linear", "full"):
            assert 0 < r[f"{kind}_step_s"] < 10
            assert r[f"{kind}_s_per_token"] == pytest.approx(r[f"{kind}_step_s"] / r["slots"])
        assert r["full_over_linear_time"] == pytest.approx(r["full_step_s"] / r["linear_step_s"])


def test_mla_decode_quick(tmp_path):
    """`bench mla_decode --quick`: both decode steps run at both contexts and compute the same
    outputs (fp32); the attention's multiply-adds per slot are absorbed H * (C * (P + Dv) +
    S * (2C + R)), expanded S * C * H * (P + Dv) + H * S * (P + R + Dv)."""
    from espo_jax.models import get_preset

    f = _quick("mla_decode", tmp_path)
    c = get_preset(f["preset"])
    assert f["preset"] == "tiny_deepseek_v3" and f["heads"] == c.n_heads
    h, cl, r = c.n_heads, c.kv_lora_rank, c.qk_rope_head_dim
    p, dv = c.qk_nope_head_dim, c.v_head_dim
    assert [row["context"] for row in f["rows"]] == [64, 512]
    for row in f["rows"]:
        s = row["context"]
        assert row["absorbed_attention_macs_per_slot"] == h * (cl * (p + dv) + s * (2 * cl + r))
        assert row["expanded_attention_macs_per_slot"] == s * cl * h * (p + dv) + h * s * (
            p + r + dv)
        assert row["output_rel_diff"] < (1e-4 if c.dtype == "float32" else 2e-2)
        for kind in ("absorbed", "expanded"):
            assert 0 < row[f"{kind}_step_s"] < 10
        assert row["expanded_over_absorbed_time"] == pytest.approx(
            row["expanded_step_s"] / row["absorbed_step_s"])
