"""The device check's sections (`espo_jax.bench.device_check`: what each measures, the
sizes, the runner that gives each its own process). Each section is a function of the sizes and
the context the runner passes (dry run, the card's nominal peaks, the measured matmul rate) that
returns its figures; JAX and espo_jax are imported inside, in the section's own process."""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import time
from typing import Any


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


FP8_PATH = ("dequant: E4M3 weights in memory, converted in each forward and multiplied in the "
            "engine's fp32 (native E4M3 GEMMs take both operands in FP8; the engine does not "
            "quantise activations)")
# The pytest section: models, losses, the train step (fp32 tests: full-precision matmuls, not
# the GPU's default TF32, which their tolerances do not allow for).
PYTEST_FILES = ("tests/models/test_attention_impl.py", "tests/models/test_cache.py",
                "tests/rl/test_losses.py", "tests/train/test_step.py")
PYTEST_DRY = ("tests/models/test_attention_impl.py::test_attention_impl_is_validated",)


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
        from espo_jax.models.flops import param_count

        base = model_config(family, ctx["dry_run"])
        fig: dict[str, Any] = {"params": param_count(base),
                               "active_params": param_count(base, active=True), "variants": []}
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
    from espo_jax.models.flops import param_count
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
    return {"params": param_count(config), "prompt_len": prompt_len,
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
