"""ESPO on Qwen3-30B-A3B at the paper's scale: vLLM FP8 rollouts, sharded JAX learner.

The setting of arXiv 2512.00499 (ESPO on Qwen3-30B-A3B): lr 1e-6, G = 8 responses per prompt,
temperature 1.0, 128 prompts per rollout batch, 16k tokens (prompt + response), router replay
(R3) from the rollout engine's recorded routing, every MS-ZVE stage (arXiv 2512.07710).

Layout (`train.loop=async`): one learner job (JAX, `jax.distributed` over its hosts) and vLLM
FP8 rollout workers on other GPUs; they meet at WORKDIR/buffer and WORKDIR/weights on a shared
filesystem (`launch/slurm_vllm.sbatch`). The TPU variant runs the learner on a TPU slice
(`launch/tpu_multihost.sh`), workers on GPUs or TPUs sharing a bucket.

    # weights: huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir /models/Qwen3-30B-A3B
    # data: math JSONL {"problem", "answer"} per line (see espo_jax/data/math_jsonl.py)
    python -m espo_jax.main --config experiments/qwen3_30b_a3b.py:hf_path=/models/Qwen3-30B-A3B \\
        --workdir /shared/espo_qwen3_30b
    launch/slurm_vllm.sbatch          # the same on a cluster (learner node + vLLM nodes)
    launch/tpu_multihost.sh           # TPU slice: experiments/qwen3_30b_a3b.py:tpu

Measured: not yet run at full scale (no GPU or TPU run). On paper only: 30,532,122,624
parameters, 3,353,032,704 active (by hand and via `jax.eval_shape` in
tests/test_qwen3_30b_config.py).

One layer's gradient at 16384 tokens, compiled on CPU XLA both ways (5c05076, 2026-12-01;
experiments/results/attention_bench.json): 145.3 GiB of temporaries with full attention,
7.73 GiB with query chunks of 1024.

Laptop-size variant (tiny MoE, arithmetic, JAX engine, sync loop; what the tests run):

    python -m espo_jax.main --config experiments/qwen3_30b_a3b.py:small --workdir /tmp/q30_small

Arguments (`:a=1,b=2`): small, tpu, hf_path, train_jsonl, test_jsonl, devices (learner devices:
8 GPUs, or the TPU slice's chips), expert (expert-parallel degree; the rest of the devices go
to fsdp), max_len (prompt + response tokens).

Choices where the papers are silent (each can be overridden with `--config.x.y=...`):
  - 1024 prompt tokens + 15360 response tokens = 16k; 4 updates per rollout batch (256
    responses each), one 16k sequence per device per micro-batch (gradient accumulation).
  - Mesh: fsdp over all learner devices. With the current rules the batch is split over
    data x fsdp only, so an `expert` axis > 1 repeats the attention compute (~80% of a
    token's FLOPs at 16k) on each of its devices; `:expert=N` exists for when the batch rule
    also covers `expert` (MaxText's choice). bf16 parameters and Adam moments: 8 bytes per
    parameter, 244 GB in all, 30.5 GB per device on 8 GPUs.
  - Memory at 16k: layers are rematerialised (`model.remat`) and attention runs over query
    chunks of 1024 (`model.attention_chunk`), whose [H, 1024, T] scores are recomputed in the
    backward pass instead of keeping [H, T, T] (32 x 16k^2 x 6 bytes = 52 GB per layer).
    `python -m espo_jax.bench attention` compiles one layer's gradient both ways (the figures
    under "Measured" above: CPU XLA's buffer assignment).
  - Constant lr after 10 warm-up steps; 500 RL steps; staleness limit 1 policy version.
"""

from espo_jax import configs
from espo_jax.rl.loss_config import paper_loss_config

PRESET = "qwen3_30b_a3b"
VOCAB = 151936  # Qwen3 tokenizer |V| (ESPO's log|V|)


def get_config(arg: str | None = None):
    arg = configs.parse_arg(
        arg, small=False, tpu=False, hf_path="/models/Qwen3-30B-A3B",
        train_jsonl="/data/math/train.jsonl", test_jsonl="/data/math/aime24.jsonl",
        devices=0, expert=1, max_len=16384,
    )
    c = configs.default_config()
    c.model.preset = PRESET  # shapes (sharding checks); the weights come from hf_path
    c.model.hf_path = arg.hf_path
    c.model.dispatch = "ragged"  # grouped matmul over experts (lax.ragged_dot)
    c.model.remat = True  # keep only each block's input for the backward pass
    c.model.attention_chunk = 1024  # query chunks: O(1024 T) attention memory, not O(T^2)
    c.tokenizer = arg.hf_path.rstrip("/") + "/tokenizer.json"
    c.data.name = "math_jsonl"
    c.data.jsonl_train = arg.train_jsonl
    c.data.jsonl_test = arg.test_jsonl

    c.loss = paper_loss_config("espo")
    c.loss.vocab_size = VOCAB
    c.advantage.name = "grpo"
    for stage in ("offline", "adaptive", "tie_break", "zvp", "online_filter", "retire"):
        c.zve[stage].enabled = True  # every MS-ZVE stage
    c.zve.n_samples = 8  # G
    c.zve.adaptive.min_samples = 8
    c.zve.adaptive.max_samples = 16
    c.zve.offline.k = 4  # stage 0 samples per prompt (each costs a full-length rollout)
    c.warmstart.steps = 0  # RL from the released checkpoint

    c.rollout.engine = "vllm"
    c.rollout.precision = "fp8"
    c.rollout.prompts_per_step = 128
    c.rollout.max_prompt_len = 1024
    c.rollout.max_new_tokens = arg.max_len - c.rollout.max_prompt_len
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.num_slots = 256
    c.rollout.engine_shards = 1  # one slot group: an accelerator runs a step's ops in parallel
    c.rollout.reward_workers = 16
    c.rollout.reward_timeout_s = 10.0

    c.optim.lr = 1e-6
    c.optim.warmup_steps = 10
    c.optim.final_lr_frac = 1.0  # constant after warm-up
    c.optim.grad_clip_norm = 1.0

    devices = arg.devices or (32 if arg.tpu else 8)  # 8 GPUs; TPU v5p-64 has 32 chips
    if devices % arg.expert:
        raise ValueError(f"devices={devices} is not divisible by expert={arg.expert}")
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, devices // arg.expert, \
        arg.expert, 1
    c.train.loop = "async"
    c.train.steps = 500
    c.train.replay = "r3"
    c.train.updates_per_batch = 4  # 1024 responses -> 4 updates of 256
    rows_per_update = c.rollout.prompts_per_step * c.zve.n_samples // c.train.updates_per_batch
    c.train.micro_batches = max(rows_per_update // (c.mesh.data * c.mesh.fsdp), 1)
    c.train.pack = False  # micro-batches of one row per sequence (packing needs one micro-batch)
    c.train.logprob_chunk = 512  # vocab projection in 512-token chunks (151936-wide logits)
    c.train.max_staleness = 1
    c.train.num_workers = 0  # vLLM workers are started by the launch script, not the learner

    c.checkpoint.every = 10
    c.checkpoint.keep = 3
    c.eval.every = 25
    c.eval.num_prompts = 30  # AIME24
    c.eval.pass_k = 8
    if arg.small:
        small(c)
    return c


def small(c):
    """The laptop variant of the same recipe: tiny MoE on arithmetic, embedded JAX engine,
    single-process loop, one device."""
    configs.apply_small(c)
    c.model.hf_path = ""
    c.model.dispatch = "dropless"
    c.model.attention_chunk = 16  # < the 32-token prompts, so the chunked path runs here too
    c.tokenizer = "char"
    c.data.name = "arith_chains"
    c.loss.vocab_size = 128  # the tiny preset's |V|
    c.zve.offline.k = 2
    c.rollout.engine = "jax"
    c.rollout.max_prompt_len = 32
    c.rollout.reward_workers = 2
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 0
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, 1, 1, 1
    c.train.loop = "sync"
    c.train.micro_batches = 1
    c.train.logprob_chunk = 64
    c.train.num_workers = 2
    c.eval.num_prompts = 8
    c.eval.pass_k = 2
    return c
