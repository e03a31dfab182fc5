"""Device check: what espo_jax does on one accelerator, in one short run.

    launch/device_check.sh [--dry_run] [OUT.json]
    python -m espo_jax.bench device_check [--dry_run] [--budget_s S] [--out OUT.json]

Sections, each in its own process under a timeout (one that fails, hangs or runs out of memory
records its error and the rest go on), all under one time budget (`--budget_s`; a section with
too little of it left is recorded as skipped):

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

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

# setup.py's packages (and the optional paths') that a bare JAX image lacks and
# launch/device_wheels.sh does not carry: nothing the check runs may import them.
NOT_IN_IMAGE = ("tensorflow", "tensorflow_datasets", "clu", "tensorboard", "math_verify",
                "reasoning_gym", "matplotlib", "hypothesis", "portpicker", "vllm", "gguf",
                "accelerate", "trl", "datasets")
SUPPORTED_JAX = ((0, 10), (0, 12))  # [lowest, first unsupported) (major, minor)
# Nominal dense bf16 FLOP/s and HBM bytes/s by the name in the device kind (H200 first: its
# kind names no H100).
NOMINAL = (("H200", 989e12, 4.8e12), ("H100", 989e12, 3.35e12))
FP8_PATH = ("dequant: E4M3 weights in memory, converted in each forward and multiplied in the "
            "engine's fp32 (native E4M3 GEMMs take both operands in FP8; the engine does not "
            "quantise activations)")
# The pytest section: models, losses, the train step (fp32 tests: full-precision matmuls, not
# the GPU's default TF32, which their tolerances do not allow for).
PYTEST_FILES = ("tests/models/test_attention_impl.py", "tests/models/test_cache.py",
                "tests/rl/test_losses.py", "tests/train/test_step.py")
PYTEST_DRY = ("tests/models/test_attention_impl.py::test_attention_impl_is_validated",)


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


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a section runs: the accelerator's sizes, or the dry run's."""

    matmul_n: int
    repeats: int
    prompts: int  # learner: prompts per rollout batch, each with `samples` responses
    samples: int
    prompt_len: int
    new_tokens: int
    slots: tuple[int, ...]  # engine
    engine_new: int
    mismatch_prompts: int
    variants: int  # learner rows run per family (the rest are the same code at other settings)
    timeouts: dict[str, float]  # per section, seconds
    budget_s: float  # the default total


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


def model_config(family: str, dry_run: bool):
    """The check's two models: `qwen3_moe` (~1.0B total, ~0.2B active) and `deepseek` (the
    DeepSeek-V3 family at ~1.0B); the `tiny` presets in a dry run. bf16 compute, fp32 weights."""
    from espo_jax.models import get_preset

    bf16 = dict(dtype="bfloat16", param_dtype="float32", dispatch="ragged")
    if dry_run:
        return get_preset("tiny" if family == "qwen3_moe" else "tiny_deepseek_v3", **bf16)
    if family == "qwen3_moe":  # Qwen3-30B-A3B's shape scaled down: 64 experts, top 8
        return get_preset("qwen3_30b_a3b", vocab_size=32768, d_model=1024, n_layers=12,
                          n_heads=16, n_kv_heads=4, head_dim=64, n_experts=64, top_k=8,
                          d_expert=384, max_seq_len=4096, **bf16)
    return get_preset(  # tiny_deepseek_v3 scaled up
        "tiny_deepseek_v3", vocab_size=32768, d_model=1024, n_layers=12, n_heads=16,
        n_kv_heads=16, head_dim=64, d_ff=2816, n_experts=64, top_k=6, d_expert=384,
        n_group=8, topk_group=4, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, rope_original_max_len=1024, max_seq_len=4096, **bf16)


def error_text(e: BaseException) -> str:
    """An exception as one line (its type and the start of its message)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:400]}"


# ---- sections (each runs in its own process: `_child`) -----------------------------------------
def section_matmul(sizes: Sizes, ctx: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from espo_jax.bench import median_time

    n = sizes.matmul_n
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16))
    seconds = median_time(lambda: dot(a, b).block_until_ready(), 5 if ctx["dry_run"] else 20,
                          warmup=2)
    return {"n": n, "bf16_matmul_flops": 2 * n**3 / seconds}


def synthetic_groups(config, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                     seed: int = 0):
    """Rollout groups as the buffer holds them, with random tokens, log-probs, recorded routing
    (k distinct experts per token and MoE layer; -1 on the last token) and 0/1 rewards."""
    import numpy as np

    from espo_jax.buffer.records import Response, RolloutGroup

    rng = np.random.default_rng(seed)
    m, k, e = config.n_moe_layers, config.top_k, config.n_experts
    groups, rewards = [], []
    for i in range(prompts):
        prompt = rng.integers(3, config.vocab_size, int(rng.integers(prompt_len // 2,
                                                                     prompt_len + 1)))
        reward = rng.integers(0, 2, samples).astype(np.float32)
        responses = []
        for j in range(samples):
            n = int(rng.integers(max(1, new_tokens // 4), new_tokens + 1))
            experts = np.argsort(rng.random((len(prompt) + n, m, e)), axis=-1)[..., :k]
            experts = experts.astype(np.int16)
            experts[-1] = -1
            responses.append(Response(
                tokens=rng.integers(3, config.vocab_size, n).astype(np.int32),
                logprobs=-rng.exponential(1.0, n).astype(np.float32), routed_experts=experts,
                finish_reason="length" if n == new_tokens else "stop",
                outcome=bool(reward[j]), reward=float(reward[j])))
        groups.append(RolloutGroup(prompt_id=f"p{i}", prompt_tokens=prompt.astype(np.int32),
                                   policy_version=0, sampler="synthetic", created_at=time.time(),
                                   rewarded_at=time.time(), responses=responses, n_experts=e))
        rewards.append(reward)
    return groups, rewards


def rl_config(config, sizes: Sizes):
    """The run config of the checked update: the default one (packing, shared prompts, R3
    replay) with the ESPO loss, one update per rollout batch, one gradient thread."""
    from espo_jax import configs
    from espo_jax.rl.loss_config import paper_loss_config

    c = configs.default_config()
    c.loss = paper_loss_config("espo")
    c.loss.vocab_size = config.vocab_size
    c.rollout.prompts_per_step, c.zve.n_samples = sizes.prompts, sizes.samples
    c.rollout.max_prompt_len, c.rollout.max_new_tokens = sizes.prompt_len, sizes.new_tokens
    c.train.updates_per_batch, c.train.micro_batches, c.train.grad_threads = 1, 1, 1
    c.train.pack, c.train.replay = True, "r3"
    c.train.logprob_chunk = 128
    c.optim.warmup_steps = 0
    return c


def learner_update(config, params, sizes: Sizes, ctx: dict) -> dict:
    """Median seconds of `Learner.update` on synthetic groups (after one compiling call), the
    tokens its rows hold, and throughput and MFU from them."""
    import jax
    import numpy as np

    from espo_jax import sharding
    from espo_jax.models.flops import train_flops_per_token
    from espo_jax.train import state as state_lib
    from espo_jax.train.learner import Learner

    c = rl_config(config, sizes)
    mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:1])
    tx = state_lib.make_optimizer(c.optim, total_steps=100)
    state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))(params)
    learner = Learner(c, config, mesh, jax.tree.map(lambda x: x.sharding, state))
    groups, rewards = synthetic_groups(config, sizes.prompts, sizes.samples, sizes.prompt_len,
                                       sizes.new_tokens)
    batches = learner.minibatches(groups, rewards)
    tokens = sum(int(np.sum(np.asarray(b.segment_ids) > 0)) for b in batches)
    width = int(np.shape(batches[0].tokens)[1])
    start = time.perf_counter()
    state, metrics = learner.update(state, groups, rewards)
    jax.block_until_ready(state)
    first_s = time.perf_counter() - start
    times = []
    for _ in range(sizes.repeats):
        start = time.perf_counter()
        state, metrics = learner.update(state, groups, rewards)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    update_s = statistics.median(times)
    flops = train_flops_per_token(config, width) * tokens / update_s
    out = {"update_s": update_s, "first_call_s": first_s, "tokens": tokens,
           "rows": int(np.shape(batches[0].tokens)[0]), "width": width,
           "tokens_per_s": tokens / update_s, "model_flops_per_s": flops,
           "mfu_measured": flops / ctx["peak_flops"] if ctx.get("peak_flops") else None,
           "mfu_nominal": (flops / ctx["nominal"]["bf16_flops"] if ctx.get("nominal")
                           else None),
           "loss": float(metrics.get("train/loss", float("nan"))),
           "temp_bytes": learner.memory_report.get("fused_step", {}).get("temp")}
    del state, learner
    return out


def section_learner(family: str, variants: tuple[tuple[str, str], ...]):
    def section(sizes: Sizes, ctx: dict) -> dict:
        import jax

        from espo_jax import sharding

        base = model_config(family, ctx["dry_run"])
        fig: dict[str, Any] = {"params": base.param_count(),
                               "active_params": base.param_count(active=True), "variants": []}
        params = None
        for i, (dispatch, attention) in enumerate(variants):
            row: dict[str, Any] = {"dispatch": dispatch, "attention_impl": attention}
            fig["variants"].append(row)
            if i >= sizes.variants:
                row["skipped"] = "dry run: the rows above run the same code"
                continue
            if time.time() > ctx["section_deadline"] - (2 if ctx["dry_run"] else 15):
                row["error"] = "skipped: the section's time is spent"
                continue
            try:
                config = base.replace(dispatch=dispatch, attention_impl=attention)
                if params is None:  # the same weights for every variant
                    c = rl_config(base, sizes)
                    params = sharding.init_sharded(
                        base, sharding.make_mesh(c.mesh, devices=jax.devices()[:1]))
                row.update(learner_update(config, params, sizes, ctx))
            except Exception as e:  # noqa: BLE001  (recorded; the next variant runs)
                row["error"] = error_text(e)
            jax.clear_caches()
        return fig

    return section


def _tree_bytes(tree) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def section_engine(sizes: Sizes, ctx: dict) -> dict:
    import jax
    import numpy as np

    from espo_jax.models import init_params
    from espo_jax.rollout.engine import Engine, Request
    from espo_jax.rollout.sampling import SamplingConfig

    config = model_config("qwen3_moe", ctx["dry_run"])
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt_len = sizes.prompt_len // 2
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=sizes.engine_new)
    rows = []
    for slots in sizes.slots:
        requests = [Request(f"e{i}", rng.integers(3, config.vocab_size, prompt_len).tolist())
                    for i in range(slots)]
        for precision in ("fp32", "bf16", "fp8"):
            row: dict[str, Any] = {"slots": slots, "precision": precision}
            rows.append(row)
            if time.time() > ctx["section_deadline"] - (2 if ctx["dry_run"] else 10):
                row["error"] = "skipped: the section's time is spent"
                continue
            try:
                engine = Engine(config, params, sampling=sampling, max_slots=slots,
                                max_cache_len=prompt_len + sizes.engine_new,
                                precision=precision, steps_per_sync=16,
                                prefill_rows=min(slots, 64), fp8_storage=precision == "fp8",
                                shards=1)
                engine.generate_groups(requests, rng=jax.random.key(0))  # compiles
                walls, stats = [], {}
                for r in range(max(2, sizes.repeats)):
                    engine.generate_groups(requests, rng=jax.random.key(r + 1))
                    stats = engine.last_stats
                    walls.append(stats["engine/wall_s"])
                wall = statistics.median(walls)
                steps = stats["engine/decode_steps"]
                embed = _tree_bytes(engine.params["embed"])
                weights = _tree_bytes(engine.params) - embed  # the lookup reads B rows only
                kv = _tree_bytes(engine.init_decode_state().cache)
                step_s = wall / steps
                row.update({"tokens_per_s": stats["engine/generated_tokens"] / wall,
                            "wall_s": wall, "decode_steps": steps, "step_s": step_s,
                            "weight_bytes": weights, "kv_bytes": kv,
                            "bytes_per_s": (weights + kv) / step_s,
                            "hbm_bound_frac": ((weights + kv) / step_s
                                               / ctx["nominal"]["hbm_bytes_per_s"]
                                               if ctx.get("nominal") else None)})
                del engine
            except Exception as e:  # noqa: BLE001
                row["error"] = error_text(e)
            jax.clear_caches()
    return {"params": config.param_count(), "prompt_len": prompt_len,
            "new_tokens": sizes.engine_new, "fp8_path": FP8_PATH, "rows": rows}


def section_mismatch(sizes: Sizes, ctx: dict) -> dict:
    import jax

    from espo_jax.models import init_params
    from espo_jax.rollout import mismatch
    from espo_jax.rollout.engine import Engine, Request
    from espo_jax.rollout.sampling import SamplingConfig

    config = model_config("qwen3_moe", ctx["dry_run"])  # the bf16 learner's model
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    engine = Engine(config, params, max_slots=sizes.mismatch_prompts * 4, shards=1,
                    max_cache_len=sizes.prompt_len + sizes.new_tokens, precision="bf16",
                    sampling=SamplingConfig(temperature=1.0, max_new_tokens=sizes.new_tokens))
    groups = engine.generate_groups(
        [Request(f"m{i}", list(range(3, 3 + sizes.prompt_len // 2 + i)))
         for i in range(sizes.mismatch_prompts)], n_samples=4, rng=jax.random.key(7))
    return {"weights": "random (init_params), not a trained policy",
            "engine": "bf16", "learner": f"{config.dtype} compute, {config.param_dtype} weights",
            **{mode: mismatch.measure_mismatch(config, params, groups, replay=replay)
               for mode, replay in (("plain", False), ("replay", True))}}


def section_pytest(sizes: Sizes, ctx: dict) -> dict:
    files = PYTEST_DRY if ctx["dry_run"] else PYTEST_FILES
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
    timeout = max(5.0, ctx["section_deadline"] - time.time() - 5)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *files], capture_output=True, text=True, env=env, timeout=timeout)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = lines[-1] if lines else ""
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    print("\n".join(lines[-40:]))
    return {"files": list(files), "returncode": proc.returncode, "passed": proc.returncode == 0,
            "summary": summary, "failed": failed[:20]}


SECTION_FNS = {
    "matmul": section_matmul,
    "learner_qwen3_moe": section_learner("qwen3_moe", (("ragged", "xla"), ("ragged", "cudnn"),
                                                       ("dropless", "xla"),
                                                       ("capacity", "xla"))),
    "learner_deepseek": section_learner("deepseek", (("ragged", "xla"), ("dropless", "xla"))),
    "engine": section_engine,
    "mismatch": section_mismatch,
    "pytest": section_pytest,
}


def _child(name: str, ctx_path: str, out_path: str) -> None:
    """Runs one section in this process; its figures (or its error) go to `out_path`."""
    with open(ctx_path) as f:
        ctx = json.load(f)
    sizes = DRY if ctx["dry_run"] else GPU
    if ctx["dry_run"]:
        import jax

        jax.config.update("jax_platforms", "cpu")
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
    print(tables(result))
    return result


if __name__ == "__main__":
    _child(*sys.argv[1:])
