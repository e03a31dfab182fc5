"""Rollout engine benchmark: each throughput idea against itself switched off, in one run.

`python -m espo_jax.bench engine [--quick] [--out FILE.json]`

On one model (`small`; `tiny` with --quick) and one set of prompts:
1. Generation throughput (generated tokens/s) of the embedded engine against transformers
   `generate` (torch CPU) on the same weights exported with `hf_io.save_pretrained`: same batch,
   prompt length and number of new tokens (no stop token, sampling at temperature 1), timed
   alternately and the medians taken. The engine also records log-probs and routing; HF does
   not. Greedy outputs of both are compared as a check that it is the same model.
2. Admission: FIFO against longest-predicted-first on requests of long-tailed lengths (the
   predictor has seen each prompt's length once, with +-20% noise): idle-slot fraction and wall.
3. Reward overlap: a reward of realistic cost (20 ms per response: a sandboxed verifier or a
   remote judge) scored (a) after generation, one by one; (b) after generation, in a 4-process
   pool; (c) in the pool while decoding goes on.
4. Precision: fp32 / FP8 with per-channel scales / FP8 with 128x128 block scales (and bf16)
   engine log-probs against the fp32 learner, without and with router replay: mean and max
   |delta logp|, the k3 KL estimate and routing flips.
5. Prefill batching: one prompt per prefill call (`prefill_rows=1`) against 16, on many short
   requests (RL on short problems: the per-call cost of prefill is then a large share).
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import jax
import numpy as np

from espo_jax import compile_cache
from espo_jax.bench import format_table
from espo_jax.bench.model import interleaved_medians
from espo_jax.bench.peer_process import hf_generator
from espo_jax.models import get_preset, hf_io, init_params
from espo_jax.rewards.pool import RewardPool
from espo_jax.rollout import mismatch, scheduling
from espo_jax.rollout.engine import Engine, Request
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.tokenizer import CharTokenizer

_TOK = CharTokenizer()
REWARD_COST_S = 0.02


def costly_reward(text: str, answer: Any) -> bool:
    """Exact match after a 20 ms wait (the cost of a sandboxed or remote verifier)."""
    time.sleep(REWARD_COST_S)
    return text.strip() == str(answer)


def decode(ids) -> str:
    return _TOK.decode(ids, errors="replace")


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


def _hf_generate(config, params, prompts: list[list[int]], new_tokens: int):
    with tempfile.TemporaryDirectory() as path:
        hf_io.save_pretrained(config, params, path, dtype="float32")
        return hf_generator(path, prompts, new_tokens)


def throughput(config, params, engines, batch, prompt_len, new_tokens, repeats) -> dict:
    prompts = _prompts(batch, prompt_len, config.vocab_size)
    reqs = [Request(f"t{i}", p) for i, p in enumerate(prompts)]
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens)
    hf, threads = _hf_generate(config, params, prompts, new_tokens)
    ours = engines["fp32"].generate_groups(reqs, sampling=greedy)
    theirs = hf(sample=False)
    agree = np.mean(
        [np.array_equal(g.responses[0].tokens, t) for g, t in zip(ours, theirs, strict=True)]
    )
    fns = {
        name: (lambda e=e: e.generate_groups(reqs, sampling=sampled, rng=jax.random.key(0)))
        for name, e in engines.items()
    }
    fns["transformers"] = hf
    for fn in fns.values():
        fn()  # warm-up (compiles)
    secs = interleaved_medians(fns, repeats)
    n = batch * new_tokens
    return {
        "tokens_per_s": {k: n / v for k, v in secs.items()},
        "greedy_agreement": agree,
        "torch_threads": threads,
        "tokens": n,
    }


def admission(engine, config, n_prompts, n_samples, max_len, repeats, seed=1) -> dict:
    rng = np.random.default_rng(seed)
    long = rng.random(n_prompts) < 0.25  # a quarter of the prompts get long answers
    lengths = np.where(
        long,
        rng.integers(max_len // 2, max_len + 1, n_prompts),
        rng.integers(4, max_len // 6 + 5, n_prompts),
    )
    prompts = _prompts(n_prompts, 8, config.vocab_size, seed)
    reqs = [
        Request(f"a{i}", p, max_new_tokens=int(n))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    predictor = scheduling.LengthPredictor()
    for r, n in zip(reqs, lengths, strict=True):  # one earlier epoch, +-20% noise
        predictor.observe(r.prompt_id, [max(1, round(n * rng.uniform(0.8, 1.2)))])

    def go(policy: str) -> dict:
        engine.generate_groups(reqs, n_samples=n_samples, admission=policy, predictor=predictor)
        return dict(engine.last_stats)

    go("fifo")  # warm-up: compiles for these shapes
    stats: dict[str, list[dict]] = {"fifo": [], "longest_first": []}
    for _ in range(repeats):  # alternately, so both see the same machine load
        for policy in stats:
            stats[policy].append(go(policy))
    return {
        policy: {
            "idle_slot_frac": runs[0]["engine/idle_slot_frac"],  # deterministic
            "decode_steps": runs[0]["engine/decode_steps"],
            "wall_s": float(np.median([r["engine/wall_s"] for r in runs])),
        }
        for policy, runs in stats.items()
    }


def overlap(engine, config, n_prompts, n_samples, new_tokens, repeats, workers=4) -> dict:
    """Per way of scoring (timed alternately, medians over `repeats`): total wall seconds, and
    the scoring time left exposed after generation ended (wall - generation wall of the same
    run), which depends little on how busy the machine is while decoding."""
    reqs = [Request(f"r{i}", p) for i, p in enumerate(_prompts(n_prompts, 8, config.vocab_size))]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    answer = "42"

    def generate(on_group=None):
        start = time.perf_counter()
        groups = engine.generate_groups(
            reqs, n_samples=n_samples, sampling=sampling, on_group=on_group
        )
        return groups, time.perf_counter() - start

    generate()  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {}
    with RewardPool(costly_reward, num_workers=workers, timeout_s=10, detokenize=decode) as pool:
        pool.submit("warm", 0, "x", answer)
        pool.wait_group("warm", 1)
        tags = iter(range(10**9))

        def serial():
            groups, gen_s = generate()
            for g in groups:
                for r in g.responses:
                    costly_reward(decode(r.tokens), answer)
            return gen_s

        def with_pool(overlapped: bool):
            tag = next(tags)

            def submit(g):
                for j, r in enumerate(g.responses):
                    pool.submit((tag, g.request_index), j, r.tokens.tolist(), answer)

            groups, gen_s = generate(on_group=submit if overlapped else None)
            if not overlapped:
                for g in groups:
                    submit(g)
            for g in groups:
                pool.wait_group((tag, g.request_index), n_samples)
            return gen_s

        modes = {
            "after, serial": serial,
            f"after, pool of {workers}": lambda: with_pool(False),
            f"overlapped, pool of {workers}": lambda: with_pool(True),
        }
        for _ in range(repeats):
            for name, fn in modes.items():
                start = time.perf_counter()
                gen_s = fn()
                runs.setdefault(name, []).append((time.perf_counter() - start, gen_s))
    return {
        name: {
            "wall_s": float(np.median([w for w, _ in r])),
            "exposed_s": float(np.median([w - g for w, g in r])),
        }
        for name, r in runs.items()
    }


def prefill_batching(config, params, n_prompts, n_samples, new_tokens, slots, repeats) -> dict:
    """Wall seconds (medians, timed alternately) of the same requests with `prefill_rows` 1 and
    16: prompts of 6-20 tokens, `new_tokens` each."""
    rng = np.random.default_rng(2)
    reqs = [Request(f"q{i}", _prompts(1, int(n), config.vocab_size, seed=i)[0])
            for i, n in enumerate(rng.integers(6, 21, n_prompts))]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    engines = {rows: Engine(config, params, sampling=sampling, max_slots=slots,
                            max_cache_len=32 + new_tokens, steps_per_sync=8, prefill_rows=rows)
               for rows in (1, 16)}
    runs = {
        rows: lambda e=e: e.generate_groups(reqs, n_samples=n_samples, rng=jax.random.key(0))
        for rows, e in engines.items()
    }
    for fn in runs.values():
        fn()  # compiles
    wall = interleaved_medians(runs, repeats)
    return {f"prefill_rows={k}": v for k, v in wall.items()}


def _scale_experts(params: dict, factor: float) -> dict:
    return {
        name: (
            {
                **layer,
                "moe": {
                    **layer["moe"],
                    **{w: layer["moe"][w] * factor for w in ("wi_gate", "wi_up", "wo")},
                },
            }
            if "moe" in layer
            else layer
        )
        for name, layer in params.items()
    }


def precision_gap(config, params, engines, n_prompts, n_samples, new_tokens) -> list[dict]:
    reqs = [Request(f"m{i}", p) for i, p in enumerate(_prompts(n_prompts, 8, config.vocab_size))]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    rows = []
    variants = [("init", params), ("experts x4", _scale_experts(params, 4.0))]
    for label, learner in variants:
        for name, engine in engines.items():
            engine.load_params(learner)
            groups = engine.generate_groups(
                reqs, n_samples=n_samples, sampling=sampling, rng=jax.random.key(7)
            )
            plain = mismatch.measure_mismatch(config, learner, groups, replay=False)
            replay = mismatch.measure_mismatch(config, learner, groups, replay=True)
            rows.append({"model": label, "precision": name, "plain": plain, "replay": replay})
        for engine in engines.values():
            engine.load_params(params)
    return rows


def run(quick: bool) -> dict:
    compile_cache.enable()
    preset = "tiny" if quick else "small"
    config = get_preset(preset)
    params = jax.device_get(jax.jit(init_params, static_argnums=0)(config, jax.random.key(0)))
    slots, cache = (8, 64) if quick else (16, 128)
    precisions = ("fp32", "fp8", "fp8_block") + (() if quick else ("bf16",))
    new = 16 if quick else 96
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new)
    engines = {
        p: Engine(
            config,
            params,
            sampling=sampling,
            max_slots=slots,
            max_cache_len=cache,
            precision=p,
            steps_per_sync=8,
        )
        for p in precisions
    }
    t = throughput(
        config,
        params,
        {k: engines[k] for k in ("fp32", "fp8")},
        slots,
        16,
        new,
        repeats=1 if quick else 5,
    )
    a = admission(
        engines["fp32"],
        config,
        12 if quick else 48,
        2 if quick else 4,
        cache - 16,
        repeats=1 if quick else 3,
    )
    o_prompts = 8 if quick else 32
    o = overlap(
        engines["fp32"],
        config,
        o_prompts,
        4,
        16 if quick else 32,
        repeats=1 if quick else 3,
    )
    m = precision_gap(
        config, params, engines, 8 if quick else 32, 2 if quick else 4, 16 if quick else 48
    )
    n_pf = 64 if quick else 256
    pf = prefill_batching(config, params, n_pf, 2, 8, 32 if quick else 128,
                          repeats=1 if quick else 3)

    print(
        f"\n### Engine throughput ({preset}, batch {slots}, prompt 16, {new} new tokens, "
        f"torch threads {t['torch_threads']}; greedy outputs identical for "
        f"{t['greedy_agreement']:.0%} of rows)\n"
    )
    tps = t["tokens_per_s"]
    print(
        format_table(
            ["generator", "tokens/s", "vs transformers"],
            [[k, v, v / tps["transformers"]] for k, v in tps.items()],
        )
    )
    print("\n### Admission (continuous batching, long-tailed lengths)\n")
    print(
        format_table(
            ["admission", "idle-slot fraction", "decode steps", "wall s"],
            [[k, v["idle_slot_frac"], v["decode_steps"], v["wall_s"]] for k, v in a.items()],
        )
    )
    n_responses = o_prompts * 4
    print(f"\n### Reward scoring ({n_responses} responses, {REWARD_COST_S * 1e3:.0f} ms each)\n")
    print(
        format_table(
            ["scoring", "wall s", "exposed after generation, s", "exposed per response, s"],
            [[k, v["wall_s"], v["exposed_s"], v["exposed_s"] / n_responses] for k, v in o.items()],
        )
    )
    print("\n### Engine log-probs vs the fp32 learner (temperature 1)\n")
    print(
        format_table(
            [
                "model",
                "engine",
                "mean abs dlogp",
                "max",
                "KL k3",
                "flip rate",
                "mean at flips",
                "mean, replay",
                "at flips, replay",
            ],
            [
                [
                    r["model"],
                    r["precision"],
                    r["plain"]["mismatch/logp_abs_mean"],
                    r["plain"]["mismatch/logp_abs_max"],
                    r["plain"]["mismatch/kl_k3"],
                    r["plain"]["moe/routing_flip_rate"],
                    r["plain"]["mismatch/logp_abs_mean_at_flips"],
                    r["replay"]["mismatch/logp_abs_mean"],
                    r["replay"]["mismatch/logp_abs_mean_at_flips"],
                ]
                for r in m
            ],
        )
    )
    print(f"\n### Prefill batching ({n_pf} prompts of 6-20 tokens x 2 samples, 8 new tokens)\n")
    base = pf["prefill_rows=1"]
    print(format_table(["prefill", "wall s", "vs one prompt per call"],
                       [[k, v, base / v] for k, v in pf.items()]))
    return {
        "preset": preset,
        "prefill_batching_s": pf,
        "throughput": t,
        "admission": a,
        "reward_overlap_s": o,
        "precision": m,
    }
