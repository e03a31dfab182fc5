"""Peers benchmark: espo_jax against TRL, transformers `generate` and torch on their own workload.

`python -m espo_jax.bench peers [--quick] [--out FILE.json]`

The workload is the one TRL's own GRPO tests use, scaled to a CPU: a random `transformers`
`Qwen3MoeForCausalLM` (vocab 64, hidden 128, 4 layers, 4 heads / 2 KV heads, head_dim 32,
8 experts top-2, moe_intermediate 256, norm_topk_prob, untied head: 3.36M parameters, fp32),
saved with `save_pretrained` and read into espo_jax with `hf_io.from_pretrained`, so both sides
run the same weights. A 64-symbol character tokenizer (`PreTrainedTokenizerFast`; its eos/pad
marker is id 64, which the model cannot emit, so every response has exactly the new-token budget
on both sides). Each side runs as its users run it: espo_jax in the benchmark's process, which
restarts under glibc's huge-page tunable as every espo_jax entry point does
(`espo_jax.host_memory`); TRL, transformers and torch in a child process under glibc's
defaults (`espo_jax.bench.peer_process`: the tunable slows TRL's step on the 2-core CPU). The
two sides are timed in alternation, one request at a time over a pipe, in turns of 3 repeats
back to back, as a training run's steps run (the drift in the machine's speed lands on both;
the side not running waits on a read; a lone repeat right after the other side's turn runs
slower on both sides), medians of 15 repeats after warm-up, compile / first-call time
reported apart:

(a) GRPO step: 8 prompts x 8 samples of 16 prompt + 32 new tokens, temperature 1, reward =
    fraction of even token ids in the response, GRPO advantages, beta 0, one AdamW update per
    generation batch. espo_jax: the embedded engine (`Engine.generate_groups`, fp32, behaviour
    log-probs and routing recorded) + the `Learner` update (GRPO loss, router replay R3).
    TRL: `GRPOTrainer` (loss_type "grpo", num_iterations 1, HF `generate`); its step is timed
    by a callback from `on_step_begin` to `on_step_end` (generation, reward, loss, backward,
    optimizer); espo_jax's turn runs after each turn of TRL's, outside TRL's timed window.
(b) Generation: 64 sequences x 48 new tokens after 16-token prompts, sampling at temperature 1:
    `Engine.generate_groups` against `model.generate(do_sample=True)` on the saved model
    (the peer's time: the parent's clock around the request, a pipe round trip included).
(c) Train step: next-token cross-entropy + router aux loss, forward + backward + AdamW on
    64 x 64 tokens, against the same in transformers + torch. espo_jax's as the
    learner runs an update (`train.grad_threads` parts of the rows, their gradients at once on
    as many threads, one AdamW update); one `jax.jit` program on all rows is timed beside it
    (`jax_one_program_tokens_per_s`).

Each prints achieved model FLOP/s (`models.flops`: PaLM's 6N + 12LHAT per trained token, 2N +
attention per generated token) against the peak of a jitted fp32 `jnp.dot` measured in the same
process.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import jax
import numpy as np

from espo_jax import configs, host_memory
from espo_jax.bench import cpu_times, format_table
from espo_jax.bench.model import (
    _jax_stepper,
    interleaved_medians,
    peak_matmul_flops,
)
from espo_jax.bench.peer_process import PeerProcess
from espo_jax.bench.rl_step import EspoStep
from espo_jax.bench.trl_peer import even_fraction
from espo_jax.models import hf_io
from espo_jax.models.config import ModelConfig
from espo_jax.models.flops import forward_flops_per_token, param_count, train_flops_per_token
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.rollout.engine import Engine, Request, auto_shards
from espo_jax.rollout.sampling import SamplingConfig

SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+="  # 64 token ids
END = "</s>"  # id 64: the tokenizer's eos / pad; the model (vocab 64) never emits it
PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 8, 8, 16, 32
GEN_SEQS, GEN_NEW = 64, 48
TRAIN_B, TRAIN_T = 64, 64
LEARNING_RATE = 1e-5


def hf_model_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(SYMBOLS), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=512, moe_intermediate_size=256,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=256,
        output_router_logits=False, pad_token_id=None, eos_token_id=None, bos_token_id=None,
        dtype="float32",
    )


def char_tokenizer():
    """A `PreTrainedTokenizerFast`: one id per character of SYMBOLS, END as eos and pad."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(SYMBOLS)} | {END: len(SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=END))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, pad_token=END,
                                   padding_side="left")


def save_workload_model(path: str, seed: int = 0) -> None:
    """The random transformers model (torch seed `seed`) and its tokenizer, saved to `path`."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(hf_model_config()).save_pretrained(path)
    char_tokenizer().save_pretrained(path)


def prompt_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(SYMBOLS[i] for i in rng.integers(0, len(SYMBOLS), PROMPT_LEN))
            for _ in range(n)]


# ---- espo_jax -----------------------------------------------------------------------------------
def grpo_config() -> Any:
    """The run config of the workload's GRPO step (one update per rollout batch)."""
    c = configs.default_config()
    c.loss = paper_loss_config("grpo")
    c.loss.vocab_size = len(SYMBOLS)
    c.advantage.name = "grpo"
    c.rollout.prompts_per_step, c.zve.n_samples = PROMPTS, SAMPLES
    c.rollout.max_prompt_len, c.rollout.max_new_tokens = PROMPT_LEN, NEW_TOKENS
    c.rollout.precision, c.rollout.temperature = "fp32", 1.0
    c.train.updates_per_batch, c.train.micro_batches, c.train.anchor_coef = 1, 1, 0.0
    c.zve.zvp.enabled = False
    c.optim.lr, c.optim.warmup_steps, c.optim.final_lr_frac = LEARNING_RATE, 0, 1.0
    c.optim.weight_decay = 0.0
    # Packed rows of a prompt's first 15 inputs and 4 of its 32-token responses (143 tokens;
    # `train.share_prompts`): the default width, twice a 47-token row, fits only two and
    # leaves the rows as full as one row per sequence (GRPO update 0.234 -> 0.204 s).
    c.train.pack_len = PROMPT_LEN - 1 + 4 * NEW_TOKENS
    return c


def engine_shards(slots: int) -> int:
    """The default config's `rollout.engine_shards` for an engine of `slots` slots (0: auto)."""
    return configs.default_config().rollout.engine_shards or auto_shards(slots)


def espo_generate(model_config: ModelConfig, params: dict, prompts: list[list[int]]):
    """A blocking generate() of GEN_SEQS samples x GEN_NEW tokens (one sample per prompt)."""
    shards = engine_shards(len(prompts))
    engine = Engine(model_config, params, sampling=SamplingConfig(
        temperature=1.0, max_new_tokens=GEN_NEW), max_slots=len(prompts),
        steps_per_sync=8, prefill_rows=len(prompts) // shards,  # one prefill call per shard
        max_cache_len=PROMPT_LEN + GEN_NEW, precision="fp32", shards=shards)
    requests = [Request(prompt_id=str(i), tokens=p, n_samples=1) for i, p in enumerate(prompts)]
    calls = [0]

    def generate() -> int:
        calls[0] += 1
        groups = engine.generate_groups(requests, rng=jax.random.key(calls[0]))
        return sum(len(x.tokens) for g in groups for x in g.responses)

    return generate


def run(quick: bool) -> dict:
    # Each side runs `block` repeats back to back per turn, as a training run's steps run (a
    # single repeat right after the other side's turn runs slower, on both sides); GRPO: both
    # sides' first turn (caches and allocators filling) is recorded but left out of the
    # medians, as are generation's and the train step's warm-ups; espo_jax's compiling step
    # runs before the turns (its first-call time).
    repeats, block = (3, 1) if quick else (15, 3)
    warmup = block
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    peak = peak_matmul_flops(1024 if quick else 2048, 3 if quick else 10)
    cpu_start = cpu_times()
    peer_env = host_memory.without_huge_pages(os.environ)  # the peers: glibc's defaults
    figures: dict[str, Any] = {"peak_matmul_flops": peak, "repeats": repeats, "block": block,
                               "cpus": os.cpu_count(), "load_average_start": os.getloadavg(),
                               "huge_pages": host_memory.huge_pages_on(),
                               "peers_huge_pages": host_memory.huge_pages_on(peer_env)}
    with tempfile.TemporaryDirectory() as tmp, PeerProcess(peer_env) as peer:
        model_dir = os.path.join(tmp, "model")
        save_workload_model(model_dir)
        model_config, params = hf_io.from_pretrained(model_dir)
        params = jax.tree.map(np.asarray, params)
        tok = char_tokenizer()
        figures["params"] = param_count(model_config)
        figures["active_params"] = param_count(model_config, active=True)

        # (a) GRPO step
        texts = prompt_texts(PROMPTS)
        ids = [tok.encode(t) for t in texts]
        assert all(len(x) == PROMPT_LEN for x in ids), "a prompt is not PROMPT_LEN tokens"
        espo = EspoStep(grpo_config(), model_config, params, ids,
                        lambda i, tokens: even_fraction(tokens))
        t0 = time.perf_counter()
        espo.step()
        espo_first = time.perf_counter() - t0
        espo_steps, splits = [], []

        trl_steps = [0]

        def espo_turn() -> None:  # after each TRL step; a turn after each turn of TRL's
            trl_steps[0] += 1
            if trl_steps[0] % block:
                return
            for _ in range(block):
                espo_steps.append(espo.step())
                splits.append(espo.last)

        trl = peer.trl(espo_turn, model_dir=model_dir, prompts=texts, steps=warmup + repeats,
                       out_dir=os.path.join(tmp, "trl"), lr=LEARNING_RATE,
                       new_tokens=NEW_TOKENS, samples=SAMPLES)
        trl_secs = trl["seconds"]
        if not len(trl_secs) == len(espo_steps) == warmup + repeats:
            raise RuntimeError(f"GRPO turns out of step: {len(trl_secs)} TRL and "
                               f"{len(espo_steps)} espo_jax steps, {warmup + repeats} expected")
        espo_warmup = espo_steps[:warmup]
        espo_steps, splits = espo_steps[warmup:], splits[warmup:]  # as TRL's, left out
        grpo = {
            "espo_step_s": statistics.median(espo_steps),
            "espo_rollout_s": statistics.median(s["generation_s"] for s in splits),
            "espo_update_s": statistics.median(s["update_s"] for s in splits),
            "espo_first_step_s": espo_first, "trl_step_s": statistics.median(trl_secs[warmup:]),
            "trl_first_step_s": trl_secs[0], "espo_steps_s": espo_steps,
            "trl_steps_s": trl_secs[warmup:], "espo_warmup_steps_s": espo_warmup,
            "trl_warmup_steps_s": trl_secs[:warmup], "trl_threads": trl["trl_threads"],
        }
        grpo["espo_over_trl"] = grpo["trl_step_s"] / grpo["espo_step_s"]
        figures["grpo_step"] = grpo

        # the peers' generation and train step, on the saved model (warmed up in the child)
        gen_prompts = [tok.encode(t) for t in prompt_texts(GEN_SEQS, seed=1)]
        tokens = np.random.default_rng(2).integers(0, len(SYMBOLS), (TRAIN_B, TRAIN_T),
                                                   dtype=np.int32)
        th = peer.request("load", model_dir=model_dir, gen_prompts=gen_prompts,
                          gen_new=GEN_NEW, train_tokens=tokens.tolist(), lr=LEARNING_RATE)

        # (b) generation
        espo_gen = espo_generate(model_config, params, gen_prompts)
        t0 = time.perf_counter()
        n_tokens = espo_gen()
        espo_gen_first = time.perf_counter() - t0
        assert n_tokens == GEN_SEQS * GEN_NEW, n_tokens
        gen_s = interleaved_medians({"espo": espo_gen, "hf": lambda: peer.request("generate")},
                                    repeats, block)
        espo_gen_s, hf_gen_s = gen_s["espo"], gen_s["hf"]
        gen_flops = sum(forward_flops_per_token(model_config, PROMPT_LEN + t, decode=True)
                        for t in range(GEN_NEW)) * GEN_SEQS
        gen = {"espo_tokens_per_s": n_tokens / espo_gen_s, "hf_tokens_per_s": n_tokens / hf_gen_s,
               "espo_first_call_s": espo_gen_first, "espo_flops_per_s": gen_flops / espo_gen_s}
        gen["espo_over_hf"] = gen["espo_tokens_per_s"] / gen["hf_tokens_per_s"]
        figures["generation"] = gen

        # (c) train step
        threads = configs.default_config().train.grad_threads
        jax_step, jx = _jax_stepper(model_config, params, tokens, threads=threads)
        one_step, _ = _jax_stepper(model_config, params, tokens)
        jax_step(), one_step()  # warm-up
        train_s = interleaved_medians(
            {"jax": jax_step, "one": one_step, "torch": lambda: peer.request("train")}, repeats,
            block)
        jax_s, torch_s = train_s["jax"], train_s["torch"]
        flops = train_flops_per_token(model_config, TRAIN_T) * TRAIN_B * TRAIN_T
        train = {"jax_tokens_per_s": TRAIN_B * TRAIN_T / jax_s,
                 "torch_tokens_per_s": TRAIN_B * TRAIN_T / torch_s,
                 "jax_flops_per_s": flops / jax_s, "torch_flops_per_s": flops / torch_s,
                 "jax_grad_threads": threads,
                 "jax_one_program_tokens_per_s": TRAIN_B * TRAIN_T / train_s["one"],
                 "jax_compile_s": jx["compile_s"], "jax_loss0": jx["loss0"],
                 "torch_loss0": th["loss0"], "torch_experts": th["experts_impl"],
                 "torch_attn": th["attn_impl"], "torch_threads": th["torch_threads"]}
        train["jax_over_torch"] = train["jax_tokens_per_s"] / train["torch_tokens_per_s"]
        figures["train_step"] = train
    figures["load_average_end"] = os.getloadavg()
    cpu_end = cpu_times()
    if cpu_start and cpu_end:  # the machine's CPU seconds over the run, and steal's share
        spent = {k: cpu_end[k] - cpu_start[k] for k in cpu_start}
        figures["cpu_seconds"] = spent
        figures["steal_frac"] = spent["steal_s"] / max(sum(spent.values()), 1e-9)

    g, ge, tr = grpo, gen, train
    print(f"peak fp32 jnp.dot: {peak / 1e9:.0f} GFLOP/s; {os.cpu_count()} CPUs; load average "
          f"{figures['load_average_start'][0]:.1f} at start, {figures['load_average_end'][0]:.1f}"
          f" at end; model {figures['params'] / 1e6:.2f}M parameters "
          f"({figures['active_params'] / 1e6:.2f}M active); medians of {repeats} in turns of "
          f"{block}; glibc huge "
          f"pages {'on' if figures['huge_pages'] else 'off'} for espo_jax, "
          f"{'on' if figures['peers_huge_pages'] else 'off'} for the peers "
          f"(their own process); CPU time stolen by the hypervisor "
          f"{100 * figures.get('steal_frac', 0.0):.1f}%")
    print(format_table(
        ["workload", "espo_jax", "peer", "espo / peer", "espo_jax FLOP/s of peak"],
        [[f"GRPO step ({PROMPTS}x{SAMPLES}, {NEW_TOKENS} new tokens, 1 AdamW update)",
          f"{g['espo_step_s']:.3f} s (rollout {g['espo_rollout_s']:.3f} + update "
          f"{g['espo_update_s']:.3f})", f"TRL GRPOTrainer {g['trl_step_s']:.3f} s",
          f"{g['espo_over_trl']:.2f}x", "-"],
         [f"generation ({GEN_SEQS} x {GEN_NEW} new tokens)",
          f"{ge['espo_tokens_per_s']:.0f} tok/s", f"HF generate {ge['hf_tokens_per_s']:.0f} tok/s",
          f"{ge['espo_over_hf']:.2f}x", f"{100 * ge['espo_flops_per_s'] / peak:.1f}%"],
         [f"train step ({TRAIN_B} x {TRAIN_T} tokens, fwd + bwd + AdamW)",
          f"{tr['jax_tokens_per_s']:.0f} tok/s", f"torch {tr['torch_tokens_per_s']:.0f} tok/s",
          f"{tr['jax_over_torch']:.2f}x", f"{100 * tr['jax_flops_per_s'] / peak:.1f}%"]]))
    print(f"train step as one jax.jit program: {tr['jax_one_program_tokens_per_s']:.0f} tok/s "
          f"({tr['jax_one_program_tokens_per_s'] / tr['torch_tokens_per_s']:.2f}x torch); with "
          f"{tr['jax_grad_threads']} gradient threads (the learner's): "
          f"{tr['jax_tokens_per_s']:.0f}")
    print(f"first call (compile) espo_jax: GRPO step {g['espo_first_step_s']:.1f} s, generation "
          f"{ge['espo_first_call_s']:.1f} s, train step {tr['jax_compile_s']:.1f} s; TRL first "
          f"step {g['trl_first_step_s']:.2f} s. Step-0 loss JAX {tr['jax_loss0']:.5f} / torch "
          f"{tr['torch_loss0']:.5f} (same weights)")
    return figures

