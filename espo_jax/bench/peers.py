"""Peers benchmark: espo_jax against TRL, transformers `generate` and torch on their own workload.

`python -m espo_jax.bench peers [--quick] [--out FILE.json]`

The workload is the one TRL's own GRPO tests use, scaled to a CPU: a random `transformers`
`Qwen3MoeForCausalLM` (vocab 64, hidden 128, 4 layers, 4 heads / 2 KV heads, head_dim 32,
8 experts top-2, moe_intermediate 256, norm_topk_prob, untied head: 3.36M parameters, fp32),
saved with `save_pretrained` and read into espo_jax with `hf_io.from_pretrained`, so both sides
run the same weights. A 64-symbol character tokenizer (`PreTrainedTokenizerFast`; its eos/pad
marker is id 64, which the model cannot emit, so every response has exactly the new-token budget
on both sides). In one process, the two sides timed in alternation (an espo_jax repeat after each
peer repeat, so drift in the machine's speed lands on both), medians of repeats after warm-up,
compile / first-call time reported apart:

(a) GRPO step: 8 prompts x 8 samples of 16 prompt + 32 new tokens, temperature 1, reward =
    fraction of even token ids in the response, GRPO advantages, beta 0, one AdamW update per
    generation batch. espo_jax: the embedded engine (`Engine.generate_groups`, fp32, behaviour
    log-probs and routing recorded) + the `Learner` update (GRPO loss, router replay R3).
    TRL: `GRPOTrainer` (loss_type "grpo", num_iterations 1, HF `generate`); its step is timed
    by a callback from `on_step_begin` to `on_step_end` (generation, reward, loss, backward,
    optimizer); an espo_jax step runs after each TRL step, outside TRL's timed window.
(b) Generation: 64 sequences x 48 new tokens after 16-token prompts, sampling at temperature 1:
    `Engine.generate_groups` against `model.generate(do_sample=True)` (`bench.engine`'s, on
    the weights exported back with `hf_io.save_pretrained`).
(c) Train step: next-token cross-entropy + router aux loss, forward + backward + AdamW on
    64 x 64 tokens, against the same in torch (`bench.model`'s steppers). espo_jax's as the
    learner runs an update (`train.grad_threads` parts of the rows, their gradients at once on
    as many threads, one AdamW update); one `jax.jit` program on all rows is timed beside it
    (`jax_one_program_tokens_per_s`).

Each prints achieved model FLOP/s (PaLM's 6N + 12LHAT per trained token, 2N + attention per
generated token) against the peak of a jitted fp32 `jnp.dot` measured in the same process.

`python -m espo_jax.bench peers` runs with glibc's allocator defaults, not under the huge-page
tunable the main job restarts with (`espo_jax.host_memory`): both sides share this process, and
the tunable slows TRL's step on the 2-core CPU while it speeds up espo_jax's update, so the
figures here are conservative for espo_jax (experiments/results/README.md, "Huge pages").
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax import configs, host_memory, sharding
from espo_jax.bench import format_table
from espo_jax.bench.engine import _hf_generate
from espo_jax.bench.model import (
    _jax_stepper,
    _torch_stepper,
    interleaved_medians,
    matmul_params_per_token,
    peak_matmul_flops,
    train_flops_per_token,
)
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.models import hf_io
from espo_jax.models.config import ModelConfig
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.rollout.engine import Engine, Request
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.train import state as state_lib
from espo_jax.train.learner import Learner

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


def even_fraction(ids) -> float:
    """The reward: the fraction of even token ids in a response."""
    ids = np.asarray(ids)
    return float(np.mean(ids % 2 == 0)) if ids.size else 0.0


def generate_flops_per_token(config: ModelConfig, context: int) -> int:
    """2N + 4LHA * context: forward matmul FLOPs of one generated token at that context."""
    c = config
    return 2 * matmul_params_per_token(c) + 4 * c.n_layers * c.n_heads * c.head_dim * context


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
    return c


class EspoGrpo:
    """Engine rollout + Learner update, the single-process loop's step without its buffer."""

    def __init__(self, model_config: ModelConfig, params: dict, prompts: list[list[int]]):
        self.config = c = grpo_config()
        self.model_config = model_config
        mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:1])
        tx = state_lib.make_optimizer(c.optim, 1000)
        self.state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))(
            jax.tree.map(jnp.asarray, params))
        self.learner = Learner(c, model_config, mesh, jax.tree.map(lambda x: x.sharding,
                                                                   self.state))
        self.engine = Engine(model_config, sampling=SamplingConfig(
            temperature=1.0, max_new_tokens=NEW_TOKENS), max_slots=PROMPTS * SAMPLES,
            steps_per_sync=c.rollout.steps_per_sync,
            prefill_rows=PROMPTS // c.rollout.engine_shards,  # one prefill call per shard
            max_cache_len=PROMPT_LEN + NEW_TOKENS, precision="fp32",
            shards=c.rollout.engine_shards)
        self.requests = [Request(prompt_id=str(i), tokens=p, n_samples=SAMPLES)
                         for i, p in enumerate(prompts)]
        self.steps = 0
        self.last: dict[str, float] = {}

    def step(self) -> float:
        t0 = time.perf_counter()
        self.engine.load_params(self.state.params)
        generated = self.engine.generate_groups(
            self.requests, rng=jax.random.fold_in(jax.random.key(1), self.steps))
        t1 = time.perf_counter()
        groups, rewards = [], []
        for g in generated:
            r = np.array([even_fraction(x.tokens) for x in g.responses], np.float32)
            rewards.append(r)
            groups.append(RolloutGroup(
                prompt_id=g.prompt_id, prompt_tokens=np.asarray(g.prompt_tokens, np.int32),
                policy_version=self.steps, sampler=self.engine.sampler_name,
                created_at=time.time(), rewarded_at=time.time(), responses=[
                    Response(tokens=x.tokens, logprobs=x.logprobs,
                             routed_experts=x.routed_experts, finish_reason=x.finish_reason,
                             outcome=bool(v > 0.5), reward=float(v))
                    for x, v in zip(g.responses, r, strict=True)],
                n_experts=self.model_config.n_experts))
        self.state, metrics = self.learner.update(self.state, groups, rewards)
        self.steps += 1
        t2 = time.perf_counter()
        self.last = {"rollout_s": t1 - t0, "update_s": t2 - t1, "loss": metrics.get(
            "train/loss", float("nan")), "reward": float(np.mean(rewards))}
        return t2 - t0


def espo_generate(model_config: ModelConfig, params: dict, prompts: list[list[int]]):
    """A blocking generate() of GEN_SEQS samples x GEN_NEW tokens (one sample per prompt)."""
    shards = configs.default_config().rollout.engine_shards
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


# ---- the peers ----------------------------------------------------------------------------------
def trl_grpo_seconds(model_dir: str, prompts: list[str], steps: int, out_dir: str,
                     between: Callable[[], object] | None = None):
    """Per-step seconds of TRL's GRPOTrainer on the workload (first step included).
    `between()`, if given, runs after each step has been timed (outside the timed window)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        """Each optimizer step's wall seconds (generation, reward, loss, backward, update)."""

        def __init__(self):
            self.seconds: list[float] = []
            self._t = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._t)
            if between is not None:
                between()

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = datasets.Dataset.from_dict({"prompt": prompts * (steps + 1)})

    def reward(completions, completion_ids, **kwargs):
        return [even_fraction(ids) for ids in completion_ids]

    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=steps, per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1, num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
        num_iterations=1, loss_type="grpo", learning_rate=LEARNING_RATE, lr_scheduler_type=
        "constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=False,
        dataloader_num_workers=0, shuffle_dataset=False, log_completions=False,
        disable_tqdm=True, seed=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    return timer.seconds, {"trl_threads": torch.get_num_threads()}


def run(quick: bool) -> dict:
    repeats = 3 if quick else 7
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    peak = peak_matmul_flops(1024 if quick else 2048, 3 if quick else 10)
    figures: dict[str, Any] = {"peak_matmul_flops": peak, "repeats": repeats,
                               "cpus": os.cpu_count(), "load_average_start": os.getloadavg(),
                               "huge_pages": host_memory.huge_pages_set()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        save_workload_model(model_dir)
        model_config, params = hf_io.from_pretrained(model_dir)
        params = jax.tree.map(np.asarray, params)
        tok = char_tokenizer()
        figures["params"] = model_config.param_count()
        figures["active_params"] = model_config.param_count(active=True)

        # (a) GRPO step
        texts = prompt_texts(PROMPTS)
        ids = [tok.encode(t) for t in texts]
        assert all(len(x) == PROMPT_LEN for x in ids), "a prompt is not PROMPT_LEN tokens"
        espo = EspoGrpo(model_config, params, ids)
        t0 = time.perf_counter()
        espo.step()
        espo_first = time.perf_counter() - t0
        espo_steps, splits = [], []

        def espo_step() -> None:  # after each TRL step: the two alternate
            espo_steps.append(espo.step())
            splits.append(espo.last)

        trl_secs, trl_info = trl_grpo_seconds(model_dir, texts, repeats + 1,
                                              os.path.join(tmp, "trl"), between=espo_step)
        espo_steps, splits = espo_steps[1:], splits[1:]  # as TRL's first step, left out
        grpo = {
            "espo_step_s": statistics.median(espo_steps),
            "espo_rollout_s": statistics.median(s["rollout_s"] for s in splits),
            "espo_update_s": statistics.median(s["update_s"] for s in splits),
            "espo_first_step_s": espo_first, "trl_step_s": statistics.median(trl_secs[1:]),
            "trl_first_step_s": trl_secs[0], "espo_steps_s": espo_steps,
            "trl_steps_s": trl_secs[1:], **trl_info,
        }
        grpo["espo_over_trl"] = grpo["trl_step_s"] / grpo["espo_step_s"]
        figures["grpo_step"] = grpo

        # (b) generation
        gen_prompts = [tok.encode(t) for t in prompt_texts(GEN_SEQS, seed=1)]
        espo_gen = espo_generate(model_config, params, gen_prompts)
        hf_gen, _ = _hf_generate(model_config, params, gen_prompts, GEN_NEW)
        t0 = time.perf_counter()
        n_tokens = espo_gen()
        espo_gen_first = time.perf_counter() - t0
        assert n_tokens == GEN_SEQS * GEN_NEW, n_tokens
        hf_gen()  # warm-up
        gen_s = interleaved_medians({"espo": espo_gen, "hf": hf_gen}, repeats)
        espo_gen_s, hf_gen_s = gen_s["espo"], gen_s["hf"]
        gen_flops = sum(generate_flops_per_token(model_config, PROMPT_LEN + t)
                        for t in range(GEN_NEW)) * GEN_SEQS
        gen = {"espo_tokens_per_s": n_tokens / espo_gen_s, "hf_tokens_per_s": n_tokens / hf_gen_s,
               "espo_first_call_s": espo_gen_first, "espo_flops_per_s": gen_flops / espo_gen_s}
        gen["espo_over_hf"] = gen["espo_tokens_per_s"] / gen["hf_tokens_per_s"]
        figures["generation"] = gen

        # (c) train step
        tokens = np.random.default_rng(2).integers(0, len(SYMBOLS), (TRAIN_B, TRAIN_T),
                                                   dtype=np.int32)
        threads = configs.default_config().train.grad_threads
        jax_step, jx = _jax_stepper(model_config, params, tokens, threads=threads)
        one_step, _ = _jax_stepper(model_config, params, tokens)
        torch_step, th = _torch_stepper(model_config, params, tokens)
        jax_step(), one_step(), torch_step()  # warm-up
        train_s = interleaved_medians({"jax": jax_step, "one": one_step, "torch": torch_step},
                                      repeats)
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

    g, ge, tr = grpo, gen, train
    print(f"peak fp32 jnp.dot: {peak / 1e9:.0f} GFLOP/s; {os.cpu_count()} CPUs; load average "
          f"{figures['load_average_start'][0]:.1f} at start, {figures['load_average_end'][0]:.1f}"
          f" at end; model {figures['params'] / 1e6:.2f}M parameters "
          f"({figures['active_params'] / 1e6:.2f}M active); medians of {repeats}; glibc huge "
          f"pages {'on' if figures['huge_pages'] else 'off'}")
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

