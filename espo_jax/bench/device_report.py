"""The device check's figures as Markdown tables (`espo_jax.bench.device_check`)."""

from __future__ import annotations


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def tables(result: dict) -> str:
    """The figures as Markdown tables."""
    from espo_jax.bench import format_table

    s = result["sections"]
    out = [f"device: {result['device']['device_kind']} ({result['device']['platform']}), JAX "
           f"{result['device']['jax']}, {result['date']}"
           + (" -- DRY RUN on CPU at tiny sizes: the figures only show the code runs"
              if result["dry_run"] else "")]
    out.append(format_table(["section", "status", "seconds", "error"], [
        [k, v["status"], round(v.get("seconds", 0.0), 1), v.get("error", "")]
        for k, v in s.items()]))
    peak = s.get("matmul", {}).get("figures", {}).get("bf16_matmul_flops")
    if peak:
        out.append(f"bf16 matmul, measured: {peak / 1e12:.2f} TFLOP/s")
    for name in ("learner_qwen3_moe", "learner_deepseek"):
        fig = s.get(name, {}).get("figures")
        if not fig:
            continue
        out.append(f"\n{name}: {fig['params'] / 1e6:.1f}M params, "
                   f"{fig['active_params'] / 1e6:.1f}M active")
        out.append(format_table(
            ["dispatch", "attention", "update s", "tokens", "tokens/s", "MFU measured",
             "MFU nominal", "first call s", "error / skipped"],
            [[r["dispatch"], r["attention_impl"], r.get("update_s", "-"), r.get("tokens", "-"),
              r.get("tokens_per_s", "-"), _pct(r.get("mfu_measured")),
              _pct(r.get("mfu_nominal")), r.get("first_call_s", "-"),
              r.get("error", r.get("skipped", ""))]
             for r in fig["variants"]]))
    fig = s.get("engine", {}).get("figures")
    if fig:
        out.append(f"\nengine (qwen3_moe, prompt {fig['prompt_len']}, {fig['new_tokens']} new "
                   f"tokens; fp8: {fig['fp8_path']})")
        out.append(format_table(
            ["slots", "weights", "tokens/s", "step ms", "GB read/step", "HBM bound", "error"],
            [[r["slots"], r["precision"], r.get("tokens_per_s", "-"),
              1e3 * r["step_s"] if "step_s" in r else "-",
              (r["weight_bytes"] + r["kv_bytes"]) / 1e9 if "weight_bytes" in r else "-",
              _pct(r.get("hbm_bound_frac")), r.get("error", "")] for r in fig["rows"]]))
    fig = s.get("mismatch", {}).get("figures")
    if fig:
        out.append(f"\nmismatch: bf16 engine vs bf16 learner ({fig['weights']})")
        out.append(format_table(
            ["router replay", "mean |dlogp|", "max |dlogp|", "KL k3", "routing flip rate"],
            [[mode, fig[mode]["mismatch/logp_abs_mean"], fig[mode]["mismatch/logp_abs_max"],
              fig[mode]["mismatch/kl_k3"], fig[mode].get("moe/routing_flip_rate", "-")]
             for mode in ("plain", "replay")]))
    fig = s.get("pytest", {}).get("figures")
    if fig:
        out.append(f"\npytest on the device: {'PASS' if fig['passed'] else 'FAIL'} "
                   f"({fig['summary']})")
    return "\n".join(out)
