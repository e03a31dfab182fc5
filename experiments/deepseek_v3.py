"""ESPO on DeepSeek-V3 (671B, 37B active) at the paper's settings: vLLM FP8 rollouts from the
published block-FP8 weights, a sharded JAX learner with expert parallelism over 256 experts.

The ESPO recipe of experiments/qwen3_30b_a3b.py (arXiv 2512.00499: lr 1e-6, G = 8, temperature
1.0, 128 prompts per rollout batch, 16k tokens, router replay R3, every MS-ZVE stage) on the
DeepSeek-V3 architecture (`deepseek_v3` preset, `espo_jax/models/config.py`): 61 layers, the
first 3 dense, multi-head latent attention (q_lora_rank 1536, kv_lora_rank 512, 128 heads of
128 + 64 rope dims, values 128), YaRN factor 40 over 4096 tokens, 256 routed experts top-8 in
8 groups searched 4 at a time, one shared expert, gates scaled by 2.5. The numbers are
transformers' DeepseekV3Config defaults (V3's config.json) plus its rope_scaling.

    # weights: huggingface-cli download deepseek-ai/DeepSeek-V3 --local-dir /models/DeepSeek-V3
    python -m espo_jax.main --config experiments/deepseek_v3.py:hf_path=/models/DeepSeek-V3 \\
        --workdir /shared/espo_dsv3
    launch/slurm_vllm.sbatch          # learner nodes + vLLM nodes on a cluster

Measured: not run at full scale (no GPU run). On paper: 671,026,419,200 parameters,
37,552,297,472 active per token (embeddings included; `ModelConfig.param_count`, the same as
`jax.eval_shape`'s; published: 671B / 37B, the multi-token-prediction layer not counted).
Per device on the 256-device learner mesh (fsdp 32 x expert 8; `espo_jax.bench.memory_plan`,
tests/test_scale_configs.py), from abstract arrays on 256 fake CPU devices (2026-12-05):
  - parameters (bf16): 6,180,524,032 bytes (5.76 GiB): experts / 256, the rest / 32, norms
    and correction biases whole
  - AdamW state (two bf16 moments): 12,361,048,072 bytes (11.51 GiB)
  - temporaries of one micro-batch's gradient (one 16k row per batch shard, remat, attention
    chunks of 1024, logits in chunks of 512), CPU XLA's buffer assignment: the slices
    "1 dense + 1 MoE layer" and "1 dense + 2 MoE layers" compiled (every layer takes too long
    on a few CPU cores), 7,002,117,575,744 and 7,126,103,851,376 bytes; scaled to 61 layers at
    the difference per layer: 14,317,307,838,032 bytes (13.0 TiB). This does NOT fit, for two
    reasons measured here: the MoE dispatch sorts the assignments of all the mesh's tokens
    together (the sort is not partitioned: on 8 devices of the tiny preset the ragged
    dispatch's temporaries grow with the device count, the dense one's do not), and CPU XLA
    expands `lax.ragged_dot` over every expert group (the 1 + 1 slice on one device with one
    16k row: 3.7 TB). A per-shard dispatch (shard_map, an all-to-all over `expert`) and a
    compile for the accelerator are what a usable figure needs.

Laptop-size variant (tiny random DeepSeek-V3 of the same family: MLA, YaRN, groups, shared
expert, dense first layer; arithmetic, JAX engine, sync loop; what the tests run):

    python -m espo_jax.main --config experiments/deepseek_v3.py:small --workdir /tmp/dsv3_small

Arguments (`:a=1,b=2`): small, hf_path, train_jsonl, test_jsonl, devices (learner devices:
256, 32 nodes of 8 GPUs), expert (expert-parallel degree, 8: one node's GPUs hold all 256
experts' shards; the rest of the devices go to fsdp), max_len (prompt + response tokens).

Choices where the papers are silent (each can be overridden with `--config.x.y=...`):
  - 1024 prompt tokens + 15360 response tokens; 4 updates per rollout batch (256 responses
    each), one 16k sequence per batch shard per micro-batch: 256 / 32 = 8 micro-batches.
  - Mesh fsdp 32 x expert 8: the batch is split over data x fsdp only, so the 8 devices of an
    expert group repeat the attention compute (MLA's share of a 16k token's FLOPs).
  - The correction bias is frozen (`model.router_bias_update_rate` 0) and the load-balancing
    loss off (DeepSeek's config: auxiliary-loss-free).
  - Constant lr after 10 warm-up steps; 500 RL steps; staleness limit 1 policy version.
"""

from espo_jax import configs
from espo_jax.rl.loss_config import paper_loss_config

PRESET = "deepseek_v3"
VOCAB = 129280  # DeepSeek-V3 tokenizer |V| (ESPO's log|V|)


def get_config(arg: str | None = None):
    arg = configs.parse_arg(
        arg, small=False, hf_path="/models/DeepSeek-V3",
        train_jsonl="/data/math/train.jsonl", test_jsonl="/data/math/aime24.jsonl",
        devices=0, expert=8, max_len=16384,
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

    devices = arg.devices or 256
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
    c.model.preset = "tiny_deepseek_v3"  # same family, tiny random weights
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
