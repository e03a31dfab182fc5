"""Profile benchmark: where a step's time goes, by model part and by kind of op.

`python -m espo_jax.bench profile [--quick] [--programs a,b] [--out FILE.json]`

Three programs, each timed (median of untraced calls) and then traced with `jax.profiler`:
- `train`: bench peers' train step (TRL's GRPO workload model, next-token loss + router aux
  loss, forward + backward + AdamW on 64 x 64 tokens);
- `generate`: bench peers' generation (the embedded engine, 64 sequences x 48 new tokens after
  16-token prompts, temperature 1);
- `update_small`: the learner's fused ESPO + R3 update with AdamW on the default experiment's
  shape (the `small` preset, 256 sequences packed; bench packing's sequences).
`--programs generate_smollm2,update_smollm2` profiles bench real's checkpoint instead
(SmolLM2-135M-Instruct) as bench real's fastest sides run it: the engine's generation in bf16
(64 x 64 new tokens after 45-token random prompts) and the `Learner`'s ESPO update in bf16 on
bench real's RL batch shape, rows packed with each prompt once per group.
`--quick` runs the `tiny` preset (SmolLM2's first two layers) on smaller shapes (a smoke test).

Every op the trace records (`hlo_op` on the XLA CPU threads, loops and conditionals counted
through their bodies) is attributed with the op's metadata in the compiled HLO: the part of
the model its `op_name` names (attention, MoE experts' matmuls, MoE routing and dispatch, norms,
the rest of the model and the loss, sampling, the optimizer), forward or backward (`transpose(`
in the name), and its kind (matmul, gather, scatter, sort, copy / transpose, dynamic slice,
elementwise and reductions). Times are thread time summed over the CPU threads, per call;
shares are of that sum. Achieved model FLOP/s (the PaLM count of `bench model`) is set against
the peak of a jitted fp32 `jnp.dot` measured in the same process, and against the matmuls'
own time: the gap between the two is the time spent outside matmuls. Beside them, per call,
the kernel's time and the minor page faults of the timed calls (`getrusage`), which the trace
cannot see: the pages of the buffers XLA allocates afresh each call (`espo_jax.host_memory`).
The attribution (reading the trace and the compiled HLO, naming each op's part, phase and kind)
is `espo_jax.bench.profile_attribution`; this module holds the programs, the timing and the
tables.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import resource
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from espo_jax import host_memory
from espo_jax.bench import format_table, median_time
from espo_jax.bench.model import jax_train_step, peak_matmul_flops
from espo_jax.bench.packing import espo_update, sequences
from espo_jax.bench.peers import engine_shards
from espo_jax.bench.profile_attribution import breakdown, compiled_text, traced_op_seconds
from espo_jax.models import get_preset, init_params
from espo_jax.models.config import ModelConfig
from espo_jax.models.flops import forward_flops_per_token, train_flops_per_token
from espo_jax.rollout import decode
from espo_jax.rollout.engine import Engine, Request
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.train import step as step_lib
from espo_jax.train.batch import pack_sequences

# bench peers' model (TRL's GRPO test model scaled to a CPU), built without transformers;
# tests/bench/test_profile_bench.py checks it against `peers.hf_model_config()`.
PEERS_MODEL = ModelConfig(
    vocab_size=64, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512,
    n_experts=8, top_k=2, d_expert=256, norm_topk_prob=True, tie_embeddings=False,
    max_seq_len=256, rope_theta=1e4, rms_eps=1e-6,
)


# ---- the three programs -------------------------------------------------------------------------
def train_program(config: ModelConfig, batch: int, seq: int):
    """bench peers' train step: (blocking call, {module: hlo}, model FLOPs per call, tokens)."""
    opt = optax.adamw(1e-5)
    step = jax.jit(functools.partial(jax_train_step, config, opt),
                   compiler_options=step_lib.compiler_options())
    params = init_params(config, jax.random.key(0))
    opt_state = opt.init(params)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (batch, seq),
                                                           dtype=np.int32))
    call = lambda: jax.block_until_ready(step(params, opt_state, tokens))
    modules = dict([compiled_text(step, params, opt_state, tokens)])
    return call, modules, train_flops_per_token(config, seq) * batch * seq, batch * seq


def generate_program(config: ModelConfig, seqs: int, prompt_len: int, new_tokens: int,
                     params: dict | None = None, precision: str = "fp32"):
    """bench peers' generation: the engine's `generate_groups`, one sample per prompt, over
    `rollout.engine_shards` shards of seqs / shards slots, one prefill call per shard; random
    prompts, and random weights unless `params` are given."""
    if params is None:
        params = init_params(config, jax.random.key(0))
    steps_per_sync = 8
    shards = engine_shards(seqs)
    engine = Engine(config, params, sampling=SamplingConfig(temperature=1.0,
                                                            max_new_tokens=new_tokens),
                    max_slots=seqs, steps_per_sync=steps_per_sync,
                    prefill_rows=seqs // shards, max_cache_len=prompt_len + new_tokens,
                    precision=precision, shards=shards)
    rng = np.random.default_rng(1)
    requests = [Request(prompt_id=str(i), n_samples=1,
                        tokens=[int(t) for t in rng.integers(0, config.vocab_size, prompt_len)])
                for i in range(seqs)]
    calls = [0]

    def call() -> int:
        calls[0] += 1
        groups = engine.generate_groups(requests, rng=jax.random.key(calls[0]))
        return sum(len(r.tokens) for g in groups for r in g.responses)

    # The decode and prefill programs exactly as each shard calls them (its slots, its rows,
    # and a decode state committed to its device, as `insert` leaves it): compiled for other
    # shapes or shardings, XLA compiles another program whose op names (its copies) differ
    # from the traced ones.
    state = decode.init_state_jit(engine.config, seqs // shards, engine.max_cache_len,
                                  engine.max_stop_tokens)
    state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
    p = engine.prefill_len(prompt_len)
    modules = dict([
        compiled_text(decode.generate_jit, engine.config, steps_per_sync, engine.params, state),
        compiled_text(decode.prefill_jit, engine.config, engine.params,
                      jnp.zeros((engine.prefill_rows, p), jnp.int32),
                      jnp.ones((engine.prefill_rows,), jnp.int32))])
    flops = seqs * sum(forward_flops_per_token(config, prompt_len + t, decode=True)
                       for t in range(new_tokens))
    return call, modules, flops, seqs * new_tokens


def update_program(config: ModelConfig, rows: int, seq_len: int):
    """The learner's fused ESPO + R3 update with AdamW on packed sequences (bench packing's)."""
    args = sequences(config, rows)
    batch = jax.tree.map(jnp.asarray, pack_sequences(
        *args, rows=rows, seq_len=seq_len, pad_id=0,
        moe_shape=(config.n_moe_layers, config.top_k), pack=True))
    update, tx = espo_update(config)
    params = init_params(config, jax.random.key(0))
    opt_state = tx.init(params)
    call = lambda: jax.block_until_ready(update(params, opt_state, batch))
    modules = dict([compiled_text(update, params, opt_state, batch)])
    real = int(np.sum(np.asarray(batch.segment_ids) > 0))
    return call, modules, train_flops_per_token(config, batch.tokens.shape[1]) * real, real


def learner_program(config: ModelConfig, params: dict, quick: bool):
    """The `Learner`'s update (ESPO, fused, AdamW; bf16, rows packed with shared prompts, as
    bench real's `espo_bfloat16_packed`) on bench real's RL batch shape, random
    prompts and responses (behaviour log-probs near -3, half of each group rewarded);
    `modules` is a callable: the learner compiles its programs on the first call."""
    from espo_jax.bench import real_workload
    from espo_jax.buffer.records import Response, RolloutGroup

    n_prompts, samples, new, _ = real_workload.rl_shape(quick)
    prompt_len = 16 if quick else 45  # bench real's chat prompts: 45 tokens
    cfg = real_workload.rl_config(config, prompt_len, quick, packed=True)
    config = dataclasses.replace(config, dtype="bfloat16")
    rng = np.random.default_rng(0)
    groups, rewards = [], []
    for i in range(n_prompts):
        r = (np.arange(samples) % 2 == 0).astype(np.float32)
        rewards.append(r)
        groups.append(RolloutGroup(
            prompt_id=str(i), prompt_tokens=rng.integers(3, config.vocab_size, prompt_len,
                                                         dtype=np.int32),
            policy_version=0, sampler="random", created_at=0.0, rewarded_at=0.0,
            responses=[Response(tokens=rng.integers(3, config.vocab_size, new, dtype=np.int32),
                                logprobs=rng.normal(-3.0, 0.3, new).astype(np.float32),
                                routed_experts=None, finish_reason="length", outcome=bool(v),
                                reward=float(v)) for v in r], n_experts=0))
    learner, call = real_workload.learner_update(cfg, config, params, groups, rewards)

    def modules() -> dict[str, str]:
        texts = [exe.as_text() for exe in learner._compiled.values()]
        return {re.search(r"HloModule\s+([\w.\-]+)", t).group(1): t for t in texts}

    width = prompt_len + new - 1
    rows = n_prompts * samples
    return call, modules, train_flops_per_token(config, width) * rows * width, rows * width


def smollm2(quick: bool) -> tuple[ModelConfig, dict]:
    """bench real's checkpoint (SmolLM2-135M-Instruct; its first 2 layers with `quick`)."""
    from espo_jax.bench import real_workload
    from espo_jax.models import hf_io

    with tempfile.TemporaryDirectory() as tmp:
        config, params = hf_io.from_pretrained(real_workload.checkpoint(
            tmp, real_workload.QUICK_LAYERS if quick else None))
    return config, jax.tree.map(np.asarray, params)


def _with_params(model: tuple[ModelConfig, dict], *args) -> tuple:
    config, params = model
    return (config, *args, params)


def profile(name: str, program, repeats: int, traced_calls: int, peak: float) -> dict:
    call, modules, flops, tokens = program
    start = time.perf_counter()
    call()  # compiles
    first_s = time.perf_counter() - start
    if callable(modules):  # compiled by the first call
        modules = modules()
    before = resource.getrusage(resource.RUSAGE_SELF)
    wall = median_time(call, repeats, warmup=0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    figures = {"wall_s": wall, "first_call_s": first_s, "tokens": tokens,
               "tokens_per_s": tokens / wall, "model_flops": flops,
               "model_flops_per_s": flops / wall, "of_peak": flops / wall / peak,
               # What the trace cannot see: the kernel's time, mostly page faults on the
               # buffers XLA allocates afresh each call (espo_jax.host_memory).
               "minor_faults_per_call": (after.ru_minflt - before.ru_minflt) / repeats,
               "system_s_per_call": (after.ru_stime - before.ru_stime) / repeats,
               "huge_pages": host_memory.huge_pages_on()}
    figures.update(breakdown(traced_op_seconds(call, traced_calls), modules, traced_calls))
    matmul_ms = figures["by_kind_ms"].get("matmul", 0.0)
    total_ms = figures["thread_ms_per_call"]
    figures["matmul_share"] = matmul_ms / total_ms if total_ms else 0.0
    print(f"\n{name}: {wall * 1e3:.1f} ms per call ({tokens / wall:.0f} tok/s, "
          f"{flops / wall / 1e9:.1f} model GFLOP/s = {100 * figures['of_peak']:.1f}% of the "
          f"jnp.dot peak); {total_ms:.1f} thread-ms per call, "
          f"{100 * figures['matmul_share']:.0f}% of it in matmuls; kernel "
          f"{1e3 * figures['system_s_per_call']:.1f} ms and "
          f"{figures['minor_faults_per_call']:.0f} minor page faults per call (huge pages "
          f"{'on' if figures['huge_pages'] else 'off'})")
    rows = [[part, *(f"{phases.get(ph, 0.0):.1f}" for ph in ("forward", "backward")),
             f"{100 * sum(phases.values()) / total_ms:.1f}%"]
            for part, phases in figures["by_part_ms"].items()]
    for label, key in (("other programs (insert, ...)", "other_programs_ms"),
                       ("ops without metadata", "unattributed_ms")):
        if figures[key]:
            rows.append([label, f"{figures[key]:.1f}", "-",
                         f"{100 * figures[key] / total_ms:.1f}%"])
    print(format_table(["part", "forward thread-ms", "backward thread-ms", "share"], rows))
    print(format_table(["kind", "thread-ms", "share"], [
        [k, f"{v:.1f}", f"{100 * v / total_ms:.1f}%"] for k, v in figures["by_kind_ms"].items()]))
    return figures


PROGRAMS = ("train", "generate", "update_small", "generate_smollm2", "update_smollm2")


def run(quick: bool, programs: list[str] | None = None) -> dict:
    """Profiles `programs` (default: the first three of PROGRAMS; the `_smollm2` two run bench
    real's checkpoint, 64 x 64 new tokens after 45-token prompts and its RL update)."""
    programs = programs or list(PROGRAMS[:3])
    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"unknown programs {unknown}; choose from {', '.join(PROGRAMS)}")
    repeats, traced = (2, 1) if quick else (7, 3)
    peak = peak_matmul_flops(1024 if quick else 2048, 3 if quick else 10)
    figures: dict[str, Any] = {"peak_matmul_flops": peak, "cpus": os.cpu_count(),
                               "load_average_start": os.getloadavg()}
    peers_model = get_preset("tiny") if quick else PEERS_MODEL
    small = get_preset("tiny" if quick else "small")
    builders = {
        "train": lambda: train_program(peers_model, 8 if quick else 64, 32 if quick else 64),
        "generate": lambda: generate_program(peers_model, 8 if quick else 64, 16,
                                             8 if quick else 48),
        "update_small": lambda: update_program(small, 32 if quick else 256, 71),
        "generate_smollm2": lambda: generate_program(
            *_with_params(smollm2(quick), 4 if quick else 64, 16 if quick else 45,
                          8 if quick else 64), precision="bf16"),
        "update_smollm2": lambda: learner_program(*smollm2(quick), quick),
    }
    print(f"peak fp32 jnp.dot: {peak / 1e9:.0f} GFLOP/s; {os.cpu_count()} CPUs; load average "
          f"{figures['load_average_start'][0]:.1f}")
    for name in programs:
        figures[name] = profile(name, builders[name](), repeats, traced, peak)
    figures["load_average_end"] = os.getloadavg()
    return figures
