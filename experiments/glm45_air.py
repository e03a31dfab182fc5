"""ESPO on GLM-4.5-Air (106B, 12B active) at the paper's settings: vLLM FP8 rollouts, a sharded
JAX learner.

The ESPO recipe of experiments/qwen3_30b_a3b.py (arXiv 2512.00499: lr 1e-6, G = 8, temperature
1.0, 128 prompts per rollout batch, 16k tokens, router replay R3, every MS-ZVE stage) on the
GLM-4.5-Air architecture (`glm45_air` preset, `espo_jax/models/config.py`): 46 layers, the first
dense (10944 hidden), GQA 96 / 8 heads of 128 with half of each head rotated and a q/k/v bias,
128 routed experts of 1408 top-8 (sigmoid router, correction bias, no groups, scale 1), one
shared expert, |V| 151552. Sources: transformers' Glm4MoeConfig defaults, which its docstring
gives as GLM-4.5-Air's; head_dim 128, `attention_bias` true and rope_theta 1e6 from
zai-org/GLM-4.5-Air's config.json (also slime's glm4.5-106B-A12B launch script: --kv-channels
128, --add-qkv-bias, --rotary-base 1000000, --rotary-percent 0.5, 1 dense + 45 MoE layers).

    # weights: huggingface-cli download zai-org/GLM-4.5-Air --local-dir /models/GLM-4.5-Air
    python -m espo_jax.main --config experiments/glm45_air.py:hf_path=/models/GLM-4.5-Air \\
        --workdir /shared/espo_glm45_air
    launch/slurm_vllm.sbatch          # learner nodes + vLLM nodes on a cluster

Measured: not run at full scale (no GPU run). On paper: 106,852,251,264 parameters,
13,424,129,664 active per token, 12,182,615,808 without the embeddings (published: 106B / 12B;
`ModelConfig.param_count`, the same as `jax.eval_shape`'s).
Per device on the 32-device learner mesh (fsdp 32; `espo_jax.bench.memory_plan`,
tests/test_scale_configs.py), from abstract arrays on 32 fake CPU devices (2026-12-05):
  - parameters (bf16): 6,680,304,128 bytes (6.22 GiB): all / 32 but norms, q/k/v biases and
    correction biases (whole)
  - AdamW state (two bf16 moments): 13,360,608,264 bytes (12.44 GiB)
  - temporaries of one micro-batch's gradient (one 16k row per device, remat, attention chunks
    of 1024, logits in chunks of 512), CPU XLA's buffer assignment: the slices "1 dense + 1 MoE
    layer" and "1 dense + 2 MoE layers" compiled, 20,215,752,379,648 and 20,545,221,711,472
    bytes; scaled to 46 layers at the difference per layer: 34,712,402,979,904 bytes (31.6 TiB).
    This does NOT fit, for two reasons measured here: the MoE dispatch sorts the assignments of
    all the mesh's tokens together (the sort is not partitioned: on 8 devices of the tiny preset
    the ragged dispatch's temporaries grow with the device count, the dense one's do not), and
    CPU XLA expands `lax.ragged_dot` over every expert group (DeepSeek-V3's 1 + 1 slice on one
    device with one 16k row: 3.7 TB). A per-shard dispatch (shard_map, an all-to-all over
    `expert`) and a compile for the accelerator are what a usable figure needs.

Laptop-size variant (tiny random GLM-4.5 of the same family: partial rotary, q/k/v bias, sigmoid
router with a shared expert and a dense first layer; arithmetic, JAX engine, sync loop):

    python -m espo_jax.main --config experiments/glm45_air.py:small --workdir /tmp/glm_small

Arguments (`:a=1,b=2`): small, hf_path, train_jsonl, test_jsonl, devices (learner devices: 32,
4 nodes of 8 GPUs), expert (expert-parallel degree, 1; the rest of the devices go to fsdp),
max_len (prompt + response tokens).

Choices where the papers are silent (each can be overridden with `--config.x.y=...`):
  - 1024 prompt tokens + 15360 response tokens; 4 updates per rollout batch (256 responses
    each), one 16k sequence per device per micro-batch: 256 / 32 = 8 micro-batches.
  - Mesh fsdp 32: 128 experts' weights split on their model dimension like every weight (no
    repeated attention compute, which an `expert` axis > 1 costs under the current batch rule).
  - The correction bias is frozen (`model.router_bias_update_rate` 0), the load-balancing loss
    off (the published config trains with the bias).
  - Constant lr after 10 warm-up steps; 500 RL steps; staleness limit 1 policy version.
"""

from espo_jax import configs
from espo_jax.rl.loss_config import paper_loss_config

PRESET = "glm45_air"
VOCAB = 151552  # GLM-4.5 tokenizer |V| (ESPO's log|V|)


def get_config(arg: str | None = None):
    arg = configs.parse_arg(
        arg, small=False, hf_path="/models/GLM-4.5-Air",
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

    devices = arg.devices or 32
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
    c.model.preset = "tiny_glm45"  # same family, tiny random weights
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
