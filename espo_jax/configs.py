"""The one place that sets every default of a run (flax `configs/default.py` style).

Experiments (`experiments/<name>.py`) start from `default_config()` and change what differs;
their recipes, and why each value is what it is, live there (measurements and tuning history in
`experiments/results/README.md`). `espo_jax.config_validation.validate(config)` checks them
before anything is compiled. `parse_arg` reads an experiment's `:arg` suffix, `apply_small`
makes the laptop-CPU variant, and `import_file` / `experiment_config` load experiment files by
path.
"""

from __future__ import annotations

import importlib.util
import os
import types

import ml_collections

from espo_jax import mesh_rules

EXPERIMENTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "experiments")  # this checkout's experiment files


def default_config() -> ml_collections.ConfigDict:
    from espo_jax.rl.loss_config import default_loss_config
    from espo_jax.zve.config import default_zve_config

    c = ml_collections.ConfigDict()
    c.seed = 0  # every RNG of the run derives from this
    c.mode = "train"  # "train": learner (+ engine in the sync loop); "rollout": a worker
    # The `:small` variants: a run that checks the stages work end to end, not a result (the
    # main job says so at start; espo_jax/run_record.py)
    c.plumbing_check = False

    c.model = ml_collections.ConfigDict()
    c.model.preset = "small"  # one of espo_jax.models.presets.PRESETS
    c.model.dispatch = "dropless_loop"  # MoE dispatch, one of DISPATCHES
    c.model.hf_path = ""  # initial weights and config: a Hugging Face directory or a .gguf file
    c.model.rope_theta = 0.0  # RoPE base; 0 keeps the preset's (Qwen3's 1e6)
    c.model.aux_loss_coef = -1.0  # load-balancing loss weight; < 0 keeps the preset's (1e-3)
    # the positions the MoE aux losses average over: "real" tokens, or "all" positions of the
    # learner's rows, padding included (packed rows have little; unpacked ones ~36% here)
    c.model.aux_loss_tokens = "real"
    c.model.remat = False  # recompute each block's activations in the backward pass
    # runs of repeating layers as one scan each: compile time and the compiler's memory do not
    # grow with depth; the learner then holds its weights in the scanned layout (models/scan.py)
    c.model.scan_layers = False
    c.model.attention_chunk = 0  # > 0: attention over query chunks of this many tokens (memory)
    c.model.ep_chunk = 0  # > 0: expert-parallel MoE exchanges of this many tokens each (memory)
    # n > 1: the learner's attention in n query blocks that skip the keys after them (always
    # masked); the same up to float summation order. n = 4: the default update 1.06x faster, but
    # each program compiles ~40% longer, a net loss over the default experiment's 120 steps on a
    # cold compilation cache (experiments/results/README.md); for long runs.
    c.model.causal_blocks = 1

    c.tokenizer = "char"  # "char", a Hugging Face tokenizer path, or "model" (hf_path's own)

    # What the run learns (espo_jax/task_loading.py): "" (the built-in data.name), "arith_chains",
    # "math_jsonl", "reasoning_gym:NAME", "files", or "package.module:function" of your own.
    c.task = ""
    c.task_args = "{}"  # JSON object: keyword arguments of the task function
    # Modules imported before the config is validated, by the main job and every rollout worker
    # (espo_jax/config_imports.py): comma-separated names (sys.path, then the working directory,
    # then experiments/) or .py paths, e.g. "my_loss" registering a loss (experiments/my_loss.py)
    c.imports = ""

    c.data = ml_collections.ConfigDict()  # the built-in tasks
    c.data.name = "arith_chains"  # TFDS builder: "arith_chains" or "math_jsonl"
    c.data.data_dir = ""  # "" -> WORKDIR/data
    c.data.train_levels = (1, 2, 3, 4, 5)  # difficulty levels RL trains on
    c.data.eval_levels = (1, 2, 3, 4, 5)  # held-out evaluation levels
    c.data.levels = ((2, 1), (3, 1), (2, 2), (3, 2), (4, 2))  # arith_chains (terms, digits)
    c.data.train_per_level = 2000  # arith_chains problems per level in the train split
    c.data.test_per_level = 200  # arith_chains problems per level in the test split
    # arith_chains problems per level in the validation split (held out beside test, disjoint
    # from both train and test; 0: no validation split)
    c.data.validation_per_level = 200
    c.data.index_hints = False  # arith_chains: letter labels on terms (index hints)
    c.data.rl_prompts = 0  # RL prompt pool: this many train prompts spread over levels (0: all)
    c.data.jsonl_train = ""  # math_jsonl: path of the training JSONL
    c.data.jsonl_test = ""  # math_jsonl: path of the test JSONL

    c.warmstart = ml_collections.ConfigDict()
    c.warmstart.steps = 0  # supervised steps on worked solutions (0: no warm start)
    c.warmstart.levels = (1, 2)  # levels the warm start sees
    c.warmstart.batch_size = 64  # worked solutions per supervised step
    c.warmstart.lr = 3e-3  # peak lr of the warm start (replaces optim.lr; same schedule shape)
    c.warmstart.eval_every = 200  # steps between accuracy checks on the warm-start levels
    c.warmstart.target_accuracy = 0.9  # stop early once greedy accuracy on its levels reaches this
    c.warmstart.max_seconds = 0.0  # stop after this much wall time (0: no limit)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # "jax" (embedded) or "vllm" (GPU workers)
    c.rollout.precision = "fp8"  # engine weights: fp32, bf16, fp8 (E4M3, per-channel scales)
    # or fp8_block (E4M3, 128x128 block scales as DeepSeek-V3's checkpoints)
    c.rollout.prompts_per_step = 16  # N prompts per rollout batch
    c.rollout.max_inflight_batches = 1  # async: a worker waits while max_staleness + this - 1
    # of its batches are unread (1: it samples batch n+1 while the learner trains on batch n)
    # Prompt tokens (bos and chat template included); a task with a longer prompt is refused.
    # 0: the task's longest prompt, rounded up to a multiple of 4 (espo_jax/task_prompts.py).
    c.rollout.max_prompt_len = 0
    c.rollout.max_new_tokens = 48  # response budget; longer samples are cut (no eos)
    c.rollout.temperature = 1.0  # sampling temperature (1: the policy's own distribution)
    c.rollout.top_p = 1.0  # nucleus mass kept (1: no truncation: samples follow the policy)
    c.rollout.top_k = 0  # 0: no top-k truncation
    c.rollout.num_slots = 64  # decode slots of the continuous-batching engine
    c.rollout.steps_per_sync = 8  # decode steps per jitted call between host syncs (no effect
    # on a sample's tokens; larger: fewer syncs, more steps run past a sample's end)
    c.rollout.prefill_rows = 16  # prompts per prefill call (padded to one length per call)
    # Slot groups of the embedded engine, each decoded by its own host thread (num_slots /
    # engine_shards slots each): on a CPU one per core (XLA runs a decode step's small ops one
    # after another); 1 on an accelerator. 0: that choice (`rollout.engine.auto_shards`: 2 on
    # a CPU of 2 or more cores, the most measured).
    c.rollout.engine_shards = 0
    c.rollout.reward_workers = 2  # reward pool workers (overlapped with decoding)
    # "process": workers are processes (parallel; one stuck in a timed-out call is killed), so
    # the task's reward must pickle (module level); "thread": threads of this process, for a
    # reward that cannot (a lambda, a closure); a timed-out call is abandoned, not killed.
    c.rollout.reward_backend = "process"
    c.rollout.reward_timeout_s = 5.0  # a reward call running longer counts as failed
    c.rollout.max_failed_reward_frac = 0.5  # a step with a larger share of responses whose reward
    # call failed or timed out stops the run (after a checkpoint)
    # vLLM workers only (rollout.engine="vllm"; espo_jax/rollout/vllm_cli.py)
    c.rollout.vllm = ml_collections.ConfigDict()
    c.rollout.vllm.quantization = "fp8"  # "fp8" (vLLM online FP8) or "none" (weights at dtype)
    c.rollout.vllm.capture_routing = True  # record routed experts (router replay R3 needs it)
    c.rollout.vllm.dtype = "bfloat16"  # activations, and weights when quantization is "none"
    c.rollout.vllm.max_model_len = 0  # tokens; 0: rollout.max_prompt_len + max_new_tokens
    c.rollout.vllm.gpu_memory_utilization = 0.85  # fraction of each GPU vLLM may take
    c.rollout.vllm.tensor_parallel_size = 1  # GPUs per vLLM engine
    c.rollout.vllm.enforce_eager = False  # True: no CUDA graphs / torch.compile (starts faster)
    c.rollout.vllm.reload = "auto"  # "inplace" (reload_weights RPC), "rebuild" (a new LLM), or
    # "auto": in place on GPUs, rebuild on CPU
    c.rollout.vllm.llm_kwargs = "{}"  # JSON dict of further vllm.LLM arguments

    c.advantage = ml_collections.ConfigDict()
    c.advantage.name = "grpo"  # grpo, dr_grpo or rloo
    c.advantage.negative_scale = 1.0  # multiplies negative token advantages (0: positive only)
    # > 0: DAPO's soft overlong punishment over the last `overlong_buffer` tokens before
    # rollout.max_new_tokens, added to each response's reward before advantages (0: off).
    c.advantage.overlong_buffer = 0

    c.loss = default_loss_config()  # the loss section (its defaults are commented there)
    c.zve = default_zve_config()  # MS-ZVE stages 0-5 (likewise)

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-3  # RL peak learning rate (AdamW)
    c.optim.warmup_steps = 10  # linear warm-up from 0 over this many updates
    c.optim.final_lr_frac = 0.1  # cosine decay ends at lr * this (1: constant after warm-up)
    c.optim.b1 = 0.9  # Adam first-moment decay
    c.optim.b2 = 0.99  # Adam second-moment decay
    c.optim.eps = 1e-8  # Adam denominator epsilon
    c.optim.weight_decay = 0.0  # AdamW decoupled decay, on matrices only (not norms)
    c.optim.grad_clip_norm = 1.0  # gradients clipped to this global norm
    # AdamW moments: float32, or bfloat16 (half the optimiser memory; DeepSeek-V3 trained so).
    # The parameters the optimiser updates are float32 masters whatever the checkpoint holds.
    c.optim.moment_dtype = "float32"

    c.train = ml_collections.ConfigDict()
    c.train.loop = "sync"  # sync (one process, on-policy) or async (learner + worker processes)
    c.train.steps = 50  # rollout batches (RL steps)
    c.train.updates_per_batch = 1  # minibatch updates per rollout batch
    # Token budget: RL also stops after the step at which the generated tokens reach this many
    # (0: off; runs compared "at an equal budget of generated tokens" set it, steps is the cap)
    c.train.max_tokens = 0
    c.train.micro_batches = 1  # gradient accumulation inside one update
    # An update's rows in this many parts (balanced by tokens, each packed on its own), their
    # gradients computed at once, each by its own host thread, then one update (the same as
    # one program on all rows; on a CPU one per core; 1 on an accelerator mesh).
    c.train.grad_threads = 2
    # Sequence packing: the learner's forward runs on rows holding several sequences each (no
    # compute on padding; the losses see one row per sequence, `espo_jax.train.batch`).
    c.train.pack = True  # needs micro_batches == 1
    c.train.pack_len = 0  # tokens per packed row (0: twice the RL row length)
    # Packed rows hold a prompt once, its responses after it attending to it (the loss is
    # the same; a group of G responses computes its prompt once instead of G times).
    c.train.share_prompts = True
    # Supervised anchor (PPO-ptx): every update also descends anchor_coef x the cross-entropy of
    # anchor_rows worked solutions of the warm-start levels.
    c.train.anchor_coef = 0.0  # weight of the anchor's cross-entropy (0: off)
    c.train.anchor_rows = 0  # worked solutions per update (0: warmstart.batch_size)
    c.train.replay = "r3"  # router replay: r3 (recorded), r2 (learner's old routing), off
    c.train.logprob_chunk = 64  # sequence chunk for log-prob / entropy computation
    c.train.max_staleness = 1  # async: drop groups older than this many policy versions
    c.train.num_workers = 2  # async: rollout worker processes
    c.train.worker_timeout_s = 300.0  # async: a worker whose status file is older is not live
    c.train.worker_restarts = 2  # async: restarts of a spawned worker process that died

    c.mesh = ml_collections.ConfigDict()
    # Mesh axis sizes; their product is the number of devices the learner uses.
    c.mesh.data = 1  # data parallel: the batch's rows
    c.mesh.fsdp = 1  # fully sharded data parallel: rows, and the weights' model dimension
    c.mesh.expert = 1  # expert parallel: the experts of every MoE layer
    c.mesh.tensor = 1  # tensor parallel: heads, MLP hidden units, vocabulary
    # Logical axis name -> mesh axes, for parameters and the model's activation constraints
    # (MaxText `logical_axis_rules`); the learner traces its steps under them.
    c.mesh.rules = mesh_rules.DEFAULT_RULES

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 10  # RL steps between checkpoints
    c.checkpoint.keep = 2  # newest checkpoints kept on disk (older ones are deleted)
    c.checkpoint.init_from = ""  # a checkpoint directory to start from when WORKDIR has none

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 25  # RL steps between held-out evaluations (0: only at start and end)
    c.eval.num_prompts = 256  # held-out prompts (greedy accuracy)
    c.eval.split = "test"  # "validation" while choosing hyperparameters; "test" for final numbers
    # With split="validation": also evaluate the test split once, after the last RL step
    # (summary.json `test_accuracy`, `test`), so runs that choose on validation report on test.
    c.eval.final_test = False
    c.eval.pass_k = 4  # pass@k with sampling at temperature 1 (0: skip)

    c.buffer = ml_collections.ConfigDict()
    c.buffer.dir = ""  # "" -> WORKDIR/buffer
    c.buffer.keep_consumed = False  # keep shards the learner has consumed

    c.log = ml_collections.ConfigDict()
    # Groups per RL step written as text to WORKDIR/samples.jsonl and TensorBoard (0: none).
    c.log.samples_per_step = 2
    return c


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """Parses an experiment's `:arg` suffix, big_vision style: `"small,steps=3"` sets the flag
    `small=True` and `steps=3`; values keep the type of their default."""
    parsed = ml_collections.ConfigDict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ValueError(f"unknown experiment argument {key!r}; valid: {sorted(defaults)}")
        default = defaults[key]
        if not value:
            parsed[key] = True
        elif isinstance(default, bool):
            parsed[key] = value.lower() in ("1", "true", "yes")
        else:
            parsed[key] = type(default)(value)
    return parsed


def apply_small(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The laptop-CPU variant every experiment has: tiny model, 2 RL steps, small batches (a
    plumbing check: accuracy is not expected to move)."""
    config.plumbing_check = True
    config.model.preset = "tiny"
    config.data.train_per_level = 16
    config.data.test_per_level = 8
    config.data.validation_per_level = min(config.data.validation_per_level, 8)
    config.warmstart.steps = min(config.warmstart.steps, 2)
    config.warmstart.batch_size = 8
    config.warmstart.eval_every = 2
    config.rollout.prompts_per_step = 4
    config.zve.n_samples = 4
    config.zve.adaptive.min_samples = 4
    config.zve.adaptive.max_samples = 4
    config.rollout.num_slots = 16
    config.rollout.max_new_tokens = 24
    config.warmstart.levels = config.warmstart.levels[:1]  # short worked solutions fit 24 tokens
    config.train.steps = 2
    config.train.updates_per_batch = 1
    config.train.micro_batches = 1
    config.checkpoint.every = 1
    config.eval.every = 0
    config.eval.num_prompts = 8
    config.eval.pass_k = 2
    return config


def import_file(path: str) -> types.ModuleType:
    """Imports a Python file by path: an experiment, or a recipe it shares with its siblings
    (`experiments/arith_common.py`), whatever the working directory and `sys.path`."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no Python file at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def experiment_config(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of `experiments/<name>.py` (what `--config experiments/<name>.py:arg`
    loads)."""
    return import_file(os.path.join(EXPERIMENTS_DIR, f"{name}.py")).get_config(arg)
