"""The ESPO recipe at real scale shared by `qwen3_30b_a3b.py`, `deepseek_v3.py` and
`glm45_air.py`; not an experiment itself (it has no `get_config`).

The setting of arXiv 2512.00499 (lr 1e-6, G = 8, temperature 1.0, 128 prompts per rollout
batch, 16k tokens, router replay R3) with every MS-ZVE stage, vLLM FP8 workers and a sharded
learner; the experiments differ by the model (preset, |V|, checkpoint) and the learner devices.
Each imports this file by path (`configs.import_file`), as the arith experiments do
`arith_common.py`; their docstrings say why each value was chosen.
"""

import ml_collections

from espo_jax import configs, mesh_rules
from espo_jax.rl.loss_config import paper_loss_config

# The `:a=1,b=2` arguments every real-scale experiment takes, with their defaults.
ARGS = dict(small=False, train_jsonl="/data/math/train.jsonl",
            test_jsonl="/data/math/aime24.jsonl", devices=0, expert=1, max_len=16384)


def espo_config(arg: ml_collections.ConfigDict, preset: str, vocab: int,
                devices: int) -> ml_collections.ConfigDict:
    """The recipe for model `preset` (tokenizer |V| `vocab`) on `devices` learner devices;
    `arg`: the parsed `ARGS` plus `hf_path` (the `:small` variant is `small`)."""
    c = configs.default_config()
    c.model.preset = preset  # shapes (sharding checks); the weights come from hf_path
    c.model.hf_path = arg.hf_path
    c.model.dispatch = "ragged"  # grouped matmul over experts (lax.ragged_dot)
    c.model.remat = True  # keep only each block's input for the backward pass
    # each run of repeating layers one scan: a 46-61 layer model compiles its layers once
    c.model.scan_layers = True
    c.model.attention_chunk = 1024  # query chunks: O(1024 T) attention memory, not O(T^2)
    # expert-parallel exchanges of 2048 tokens: dropless buffers of ep x 2048 x k rows, not
    # ep x 16k x k (a million rows of d_model per buffer at ep 8, top-8)
    c.model.ep_chunk = 2048
    c.tokenizer = arg.hf_path.rstrip("/") + "/tokenizer.json"
    c.data.name = "math_jsonl"
    c.data.jsonl_train = arg.train_jsonl
    c.data.jsonl_test = arg.test_jsonl

    c.loss = paper_loss_config("espo")
    c.loss.vocab_size = vocab
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

    if devices % arg.expert:
        raise ValueError(f"devices={devices} is not divisible by expert={arg.expert}")
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, devices // arg.expert, \
        arg.expert, 1
    c.train.loop = "async"
    c.train.steps = 500
    c.train.replay = "r3"
    c.train.updates_per_batch = 4  # 1024 responses -> 4 updates of 256
    rows_per_update = c.rollout.prompts_per_step * c.zve.n_samples // c.train.updates_per_batch
    c.train.micro_batches = max(rows_per_update // mesh_rules.batch_shards(c.mesh), 1)
    c.train.pack = False  # micro-batches of one row per sequence (packing needs one micro-batch)
    c.train.logprob_chunk = 512  # vocab projection in 512-token chunks (|V| ~ 1.5e5)
    c.train.max_staleness = 1
    c.train.num_workers = 0  # vLLM workers are started by the launch script, not the learner

    c.checkpoint.every = 10
    c.checkpoint.keep = 3
    c.eval.every = 25
    c.eval.num_prompts = 30  # AIME24
    c.eval.pass_k = 8
    return c


def small(c: ml_collections.ConfigDict, preset: str,
          arg: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
    """The laptop variant of the same recipe: tiny MoE on arithmetic, embedded JAX engine,
    single-process loop, one device; with `:devices=N` (and `expert=E`) given, N devices,
    fsdp N / E x expert E (what `bench aot` compiles for a small TPU slice)."""
    configs.apply_small(c)
    c.model.preset = preset  # the family's tiny random weights
    c.model.hf_path = ""
    c.model.dispatch = "dropless"
    c.model.attention_chunk = 16  # < the 32-token prompts, so the chunked path runs here too
    c.model.ep_chunk = 16  # < a device's tokens: expert-parallel exchanges in chunks here too
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
    if arg is not None and arg.devices:
        c.mesh.fsdp, c.mesh.expert = arg.devices // arg.expert, arg.expert
    c.train.loop = "sync"
    c.train.micro_batches = 1
    c.train.logprob_chunk = 64
    c.train.num_workers = 2
    c.eval.num_prompts = 8
    c.eval.pass_k = 2
    return c
