"""Device check: what espo_jax does on one accelerator, in one short run.

    launch/device_check.sh [--dry_run] [OUT.json]
    python -m espo_jax.bench device_check [--dry_run] [--budget_s S] [--out OUT.json]

This module is the runner (sizes, one process per section, the budget, the json);
`device_sections` holds the sections, `device_report` the tables. Sections, each in its own
process under a timeout (one that fails, hangs or runs out of memory records its error and the
rest go on), all under one time budget (`--budget_s`; a section with too little of it left is
recorded as skipped):

  matmul            the in-process bf16 matmul rate ([n, n] @ [n, n], 2 n^3 FLOPs, median): the
                    measured peak the MFUs below are also given against.
  learner_qwen3_moe the learner's RL update as training runs it (`train.learner.Learner.update`:
                    packed rows, R3 router replay, the ESPO loss, AdamW; bf16 compute, fp32
                    weights) on a Qwen3-MoE of ~1.0B parameters, ~0.2B active per token; one
                    row per MoE dispatch (`models.moe_dispatch`: ragged = `lax.ragged_dot`,
                    dropless, capacity) and attention implementation (`ModelConfig.
                    attention_impl`: xla, cudnn). Synthetic rollout groups (random tokens,
                    log-probs, routing and rewards; the update's work does not depend on them).
  learner_deepseek  the same update on the DeepSeek-V3 family (`tiny_deepseek_v3` scaled up: MLA,
                    a dense first layer, a shared expert, sigmoid group-limited routing), ~1.0B.
  engine            the rollout engine (`rollout.engine.Engine`) on the Qwen3-MoE: generated
                    tokens/s at 64 and 256 slots with fp32, bf16 and FP8 weights, and the share
                    of the HBM bound: (weights + KV cache bytes, as a decode step reads them) /
                    step time / the card's nominal bandwidth.
  mismatch          a bf16 engine's log-probs against the bf16 learner's, without and with
                    router replay (`rollout.mismatch.measure_mismatch`), on random weights.
  pytest            a ~1 minute subset of the tests (models, losses, train step) on the device.

Model FLOPs per trained token: `models.flops.train_flops_per_token` (6 N + 6 L H (d_qk + d_v) W,
PaLM's arXiv 2204.02311 App. B with MLA's head dims; N the weights a token multiplies, W the
packed row width, no causal discount). MFU is given against the measured matmul rate and
against the card's nominal dense bf16 rate (H100 / H200 SXM: 989 TFLOP/s; HBM 3.35 / 4.8 TB/s),
where the device name says which card it is.

`--dry_run` runs every section's code on the CPU at tiny sizes (CI: tests/bench/
test_device_check.py); its figures say only that the code runs. JAX 0.10 and 0.11 are supported
(`jax_version_error`); another version stops the check before any section.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from espo_jax.bench import device_report
from espo_jax.bench.device_sections import Sizes

# setup.py's packages (and the optional paths') that a bare JAX image lacks and
# launch/device_wheels.sh does not carry: nothing the check runs may import them.
NOT_IN_IMAGE = ("tensorflow", "tensorflow_datasets", "clu", "tensorboard", "math_verify",
                "reasoning_gym", "matplotlib", "hypothesis", "portpicker", "vllm", "gguf",
                "accelerate", "trl", "datasets")
SUPPORTED_JAX = ((0, 10), (0, 12))  # [lowest, first unsupported) (major, minor)
# Nominal dense bf16 FLOP/s and HBM bytes/s by the name in the device kind (H200 first: its
# kind names no H100).
NOMINAL = (("H200", 989e12, 4.8e12), ("H100", 989e12, 3.35e12))


def jax_version_error(version: str) -> str | None:
    """Why this JAX version is not supported (None: it is). 0.11.0's breaking changes (jnp.empty
    uninitialised, jax.core and jax.interpreters.pxla names removed, jax.cloud_tpu_init gone,
    jax.checkpoint_policies a module, Python 3.11 dropped; jax.lax.top_k gained `is_stable`,
    default True as before) touch no API espo_jax calls: the same code runs on 0.10.2 and 0.11."""
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return f"cannot read JAX version {version!r}"
    lo, hi = SUPPORTED_JAX
    if not lo <= major_minor < hi:
        return (f"JAX {version} is not supported: espo_jax runs on JAX >= {lo[0]}.{lo[1]} and "
                f"< {hi[0]}.{hi[1]} (tested on 0.10.2; read against the 0.11.0 changelog)")
    return None


def nominal_peaks(device_kind: str) -> dict[str, float] | None:
    """The card's nominal dense bf16 FLOP/s and HBM bytes/s, where its name is known."""
    for name, flops, bandwidth in NOMINAL:
        if name in device_kind.upper():
            return {"card": name, "bf16_flops": flops, "hbm_bytes_per_s": bandwidth}
    return None


GPU = Sizes(matmul_n=8192, repeats=3, prompts=16, samples=8, prompt_len=64, new_tokens=256,
            slots=(64, 256), engine_new=128, mismatch_prompts=16, variants=4,
            timeouts={"matmul": 30, "learner_qwen3_moe": 140, "learner_deepseek": 70,
                      "engine": 90, "mismatch": 40, "pytest": 80}, budget_s=450)
DRY = Sizes(matmul_n=128, repeats=1, prompts=2, samples=2, prompt_len=8, new_tokens=8,
            slots=(4,), engine_new=8, mismatch_prompts=2, variants=2,
            timeouts={"matmul": 60, "learner_qwen3_moe": 150, "learner_deepseek": 120,
                      "engine": 150, "mismatch": 120, "pytest": 60}, budget_s=600)
SECTIONS = ("matmul", "learner_qwen3_moe", "learner_deepseek", "engine", "mismatch", "pytest")
MIN_SECTION_S = 10.0  # a section with less of the budget left is skipped


def _child(name: str, ctx_path: str, out_path: str) -> None:
    """Runs one section in this process; its figures (or its error) go to `out_path`."""
    with open(ctx_path) as f:
        ctx = json.load(f)
    sizes = DRY if ctx["dry_run"] else GPU
    if ctx["dry_run"]:
        import jax

        jax.config.update("jax_platforms", "cpu")
    from espo_jax.bench.device_sections import SECTION_FNS, error_text

    try:
        result = {"status": "ok", "figures": SECTION_FNS[name](sizes, ctx)}
    except Exception as e:  # noqa: BLE001  (the parent records it and goes on)
        traceback.print_exc()
        result = {"status": "error", "error": error_text(e)}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2, default=float)


# ---- the parent: device facts, sections under timeouts, tables, one json ------------------------
def device_facts() -> dict:
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {"platform": dev.platform, "device_kind": dev.device_kind,
            "device_count": jax.device_count(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "python": sys.version.split()[0]}


def _run_child(name: str, ctx: dict, timeout_s: float, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ctx_path, out_path = os.path.join(tmp, "ctx.json"), os.path.join(tmp, "out.json")
        with open(ctx_path, "w") as f:
            json.dump(ctx, f)
        env = dict(env)
        if ctx["dry_run"]:
            env["JAX_PLATFORMS"] = "cpu"
        proc = subprocess.Popen([sys.executable, "-m", "espo_jax.bench.device_check", name,
                                 ctx_path, out_path], env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the section and anything it started
            proc.wait()
            return {"status": "timeout", "error": f"timed out after {timeout_s:.0f} s"}
        if not os.path.exists(out_path):
            return {"status": "error",
                    "error": f"the section's process ended with status {rc} and no result "
                             "(killed for memory, or a crash in native code)"}
        with open(out_path) as f:
            return json.load(f)


def run(quick: bool = False, dry_run: bool = False, budget_s: float | None = None,
        out: str | None = None) -> dict:
    """Every section under the budget; the figures, written to `out` after each section."""
    import jax

    problem = jax_version_error(jax.__version__)
    if problem:
        raise SystemExit(f"[device_check] {problem}")
    child_env = dict(os.environ)  # the sections' processes get the device's memory, not this one
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if dry_run:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() == "cpu":
        raise SystemExit("[device_check] no accelerator: JAX sees only the CPU (run with "
                         "--dry_run to check the code paths there)")
    sizes = DRY if dry_run else GPU
    budget = sizes.budget_s if budget_s is None else budget_s
    start = time.time()
    deadline = start + budget
    device = device_facts()
    print(f"[device_check] {device['device_kind']} x{device['device_count']}, JAX "
          f"{device['jax']} (jaxlib {device['jaxlib']}), Python {device['python']}; budget "
          f"{budget:.0f} s{', dry run on CPU' if dry_run else ''}", flush=True)
    result = {"dry_run": dry_run, "quick": quick, "budget_s": budget, "device": device,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)),
              "nominal": nominal_peaks(device["device_kind"]), "sections": {}}
    ctx = {"dry_run": dry_run, "nominal": result["nominal"], "peak_flops": None}
    for name in SECTIONS:
        left = deadline - time.time()
        if left < MIN_SECTION_S:
            result["sections"][name] = {"status": "skipped", "seconds": 0.0,
                                        "error": f"budget spent ({left:.0f} s left)"}
            continue
        timeout = min(sizes.timeouts[name], left)
        print(f"[device_check] {time.strftime('%H:%M:%S')} {name} (<= {timeout:.0f} s)",
              flush=True)
        t0 = time.time()
        section = _run_child(name, {**ctx, "section_deadline": t0 + timeout}, timeout,
                             child_env)
        section["seconds"] = time.time() - t0
        result["sections"][name] = section
        if name == "matmul" and section["status"] == "ok":
            ctx["peak_flops"] = section["figures"]["bf16_matmul_flops"]
        result["total_s"] = time.time() - start
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=2, default=float)
    print(device_report.tables(result))
    return result


if __name__ == "__main__":
    _child(*sys.argv[1:])
