"""`validate(config)`: the checks a run's config passes before anything is compiled.

Names, choices, bounds, divisibility (batch vs group size vs mesh), the paths a run reads, and
the key combinations the run's layout cannot run (the async loop's workers), each error naming
the keys and the allowed values; every problem is reported at once. The defaults themselves are
set in `espo_jax/configs.py`.
"""

from __future__ import annotations

import os

import ml_collections

from espo_jax import mesh_rules
from espo_jax.choices import (
    BUILTIN_DATA,
    ENGINE_PRECISIONS,
    MOMENT_DTYPES,
    REPLAY_MODES,
    VLLM_DTYPES,
    VLLM_QUANTIZATIONS,
    VLLM_RELOADS,
)
from espo_jax.models.config import AUX_LOSS_TOKENS, DISPATCHES
from espo_jax.models.presets import PRESETS
from espo_jax.rewards.pool import BACKENDS as REWARD_BACKENDS

LOOPS = ("sync", "async")
ENGINES = ("jax", "vllm")
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
MODES = ("train", "rollout")


def _get(config, key: str):
    """`config.<key>` for a dotted key, e.g. "zve.zvp.alpha"."""
    for part in key.split("."):
        config = config[part]
    return config


def _choice(errors: list[str], config, key: str, allowed) -> None:
    value = _get(config, key)
    if value not in allowed:
        errors.append(f"config.{key}={value!r} is not one of {tuple(allowed)}")


# key, lowest value, whether the lowest value itself is allowed, highest value (None: none)
_BOUNDS = (
    *((key, 1, True, None) for key in (
        "rollout.prompts_per_step", "zve.n_samples", "rollout.max_new_tokens",
        "rollout.num_slots", "rollout.steps_per_sync", "rollout.prefill_rows",
        "train.updates_per_batch", "train.micro_batches", "train.grad_threads",
        "mesh.data", "mesh.fsdp", "mesh.expert", "mesh.tensor", "train.logprob_chunk",
        "rollout.max_inflight_batches")),
    ("optim.lr", 0.0, False, None),
    ("warmstart.lr", 0.0, False, None),
    ("optim.warmup_steps", 0, True, None),
    ("train.pack_len", 0, True, None),
    ("rollout.engine_shards", 0, True, None),
    ("optim.final_lr_frac", 0.0, True, 1.0),
    ("warmstart.batch_size", 1, True, None),
    ("checkpoint.every", 1, True, None),
    ("checkpoint.keep", 1, True, None),
    ("eval.every", 0, True, None),
    ("eval.num_prompts", 1, True, None),
    ("eval.pass_k", 0, True, None),
    ("log.samples_per_step", 0, True, None),
    ("rollout.top_k", 0, True, None),
    ("rollout.top_p", 0.0, False, 1.0),
    ("rollout.reward_workers", 1, True, None),
    ("rollout.reward_timeout_s", 0.0, False, None),
    ("rollout.max_failed_reward_frac", 0.0, True, 1.0),
    ("train.max_staleness", 0, True, None),
    ("train.num_workers", 0, True, None),  # 0: the launch script starts the workers
    ("train.worker_timeout_s", 0.0, False, None),
    ("train.worker_restarts", 0, True, None),
    ("zve.zvp.alpha", 0.0, True, None),
    ("seed", 0, True, None),
    ("advantage.overlong_buffer", 0, True, None),
    ("rollout.max_prompt_len", 0, True, None),  # 0: the task's longest prompt
    ("data.rl_prompts", 0, True, None),  # 0: every training prompt
    ("data.train_per_level", 1, True, None),
    ("data.test_per_level", 1, True, None),
    ("data.validation_per_level", 0, True, None),
    ("train.max_tokens", 0, True, None),
    ("warmstart.steps", 0, True, None),
    ("warmstart.eval_every", 1, True, None),
    ("warmstart.target_accuracy", 0.0, True, 1.0),
    ("optim.b1", 0.0, True, 0.999999),
    ("optim.b2", 0.0, True, 0.999999),
    ("optim.eps", 0.0, False, None),
    ("optim.grad_clip_norm", 0.0, False, None),
    ("optim.weight_decay", 0.0, True, None),
    ("zve.adaptive.min_obs", 0.0, True, None),
    ("zve.tie_break.tier_gap", 0.0, False, None),
    ("rollout.vllm.max_model_len", 0, True, None),  # 0: max_prompt_len + max_new_tokens
    ("rollout.vllm.gpu_memory_utilization", 0.0, False, 1.0),
    ("rollout.vllm.tensor_parallel_size", 1, True, None),
)


def _validate_paths(errors: list[str], config: ml_collections.ConfigDict,
                    check_paths: bool) -> None:
    """Paths a run reads must exist (directories it writes are created); the vLLM keyword
    arguments must be a JSON object; level lists must not be empty."""
    import json

    reads = [("model.hf_path", config.model.hf_path),
             ("checkpoint.init_from", config.checkpoint.init_from)]
    if config.tokenizer not in ("char", "model"):
        reads.append(("tokenizer", config.tokenizer))
    elif config.tokenizer == "model" and not config.model.hf_path:
        errors.append("config.tokenizer='model' (the checkpoint's own tokenizer) needs "
                      "config.model.hf_path")
    if (config.task or config.data.name) == "math_jsonl":
        reads += [("data.jsonl_train", config.data.jsonl_train),
                  ("data.jsonl_test", config.data.jsonl_test)]
        for key in ("data.jsonl_train", "data.jsonl_test"):
            if not _get(config, key):
                errors.append(f"config.{key} must be set for the math_jsonl task")
    for key, path in reads if check_paths else ():
        if path and not os.path.exists(path):
            errors.append(f"config.{key}={path!r} does not exist")
    try:
        kwargs = json.loads(config.rollout.vllm.llm_kwargs or "{}")
    except json.JSONDecodeError:
        kwargs = None
    if not isinstance(kwargs, dict):
        errors.append(f"config.rollout.vllm.llm_kwargs must be a JSON object, got "
                      f"{config.rollout.vllm.llm_kwargs!r}")
    for key in ("data.train_levels", "data.eval_levels"):
        if not _get(config, key):
            errors.append(f"config.{key} must not be empty")
    if config.warmstart.steps > 0 and not config.warmstart.levels:
        errors.append("config.warmstart.steps > 0 needs config.warmstart.levels (the levels "
                      "whose worked solutions it trains on)")


def _validate_extras(errors: list[str], config: ml_collections.ConfigDict) -> None:
    """A GGUF checkpoint or Parquet prompt files need packages `pip install -e .` leaves out:
    each absent one is named with the extra that installs it (`espo_jax.extras`)."""
    from espo_jax import extras
    from espo_jax.task_loading import task_args

    uses = []
    path = config.model.hf_path
    if path.endswith(".gguf") and os.path.isfile(path):
        from espo_jax.models import gguf

        if not gguf.is_converted(path):  # a converted copy is read without them
            uses.append(("gguf", f"config.model.hf_path={path!r}"))
    if config.task == "files":
        try:
            args = task_args(config)
        except ValueError:  # reported by _validate_task
            args = {}
        parquet = [k for k in ("train", "validation", "test")
                   if str(args.get(k, "")).endswith(".parquet")]
        if parquet:
            uses.append(("parquet", f"config.task_args {', '.join(parquet)}"))
    for extra, where in uses:
        absent = extras.missing(extra)
        if absent:
            errors.append(f"{where}: {extras.hint(extra, absent)}")


def _validate_task(errors: list[str], config: ml_collections.ConfigDict) -> None:
    """`config.task` has one of the forms of espo_jax/task_loading.py and `config.task_args` is a
    JSON object (no task is imported or generated here)."""
    import re

    spec = config.task
    known = True  # a task whose task_args can be checked without importing the user's code
    if spec.startswith("reasoning_gym:"):
        from reasoning_gym.factory import DATASETS

        name = spec.partition(":")[2]
        known = name in DATASETS
        if not known:
            errors.append(f"config.task={spec!r}: reasoning-gym has no dataset {name!r} (e.g. "
                          f"{', '.join(sorted(DATASETS)[:6])}, ...)")
    elif spec not in ("", "arith_chains", "math_jsonl", "files") and not re.fullmatch(
            r"([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_]\w*", spec):
        errors.append(f"config.task={spec!r} is not '' / 'arith_chains' / 'math_jsonl' / "
                      "'files' / 'reasoning_gym:NAME' / 'package.module:function' / "
                      "'path/to/file.py:function'")
    from espo_jax.task_loading import task_args

    try:
        args = task_args(config)
    except ValueError as e:
        errors.append(str(e))
        return
    if args and spec in ("", "arith_chains", "math_jsonl"):
        errors.append(f"config.task_args={config.task_args!r} given for a built-in task, which "
                      "reads config.data.* instead")
    elif spec == "files" and not {"train", "test"} <= set(args):
        errors.append("config.task='files' needs config.task_args with 'train' and 'test' "
                      f"paths, got {config.task_args!r}")
    elif known and (spec == "files" or spec.startswith("reasoning_gym:")):
        from espo_jax.task_loading import check_builtin_task_args

        try:
            check_builtin_task_args(config)
        except ValueError as e:
            errors.append(str(e))


def validate(config: ml_collections.ConfigDict, n_devices: int = 1, *,
             check_paths: bool = True) -> None:
    """Raises ValueError listing every problem, each naming its key and the allowed values;
    imports `config.imports` first (`espo_jax.config_imports`: losses registered there are valid).
    `check_paths=False` validates on paper (a cluster's config on a laptop): the paths it reads
    are not looked for, nor the optional packages they need (`espo_jax.extras`)."""
    from espo_jax import config_imports
    from espo_jax.rl.loss_config import validate_loss_config
    from espo_jax.zve.config import validate_zve_config

    errors: list[str] = []
    try:  # first: the modules may register losses the checks below accept
        config_imports.import_modules(config)
    except ValueError as e:
        errors.append(str(e))
    _choice(errors, config, "mode", MODES)
    _choice(errors, config, "model.preset", PRESETS)
    _choice(errors, config, "model.dispatch", DISPATCHES)
    _choice(errors, config, "model.aux_loss_tokens", AUX_LOSS_TOKENS)
    _choice(errors, config, "data.name", BUILTIN_DATA)
    _choice(errors, config, "eval.split", ("validation", "test"))
    _choice(errors, config, "rollout.vllm.quantization", VLLM_QUANTIZATIONS)
    _choice(errors, config, "rollout.vllm.reload", VLLM_RELOADS)
    _choice(errors, config, "rollout.vllm.dtype", VLLM_DTYPES)
    _validate_task(errors, config)
    _validate_paths(errors, config, check_paths)
    if check_paths:
        _validate_extras(errors, config)
    _choice(errors, config, "rollout.engine", ENGINES)
    _choice(errors, config, "rollout.precision", ENGINE_PRECISIONS)
    _choice(errors, config, "rollout.reward_backend", REWARD_BACKENDS)
    _choice(errors, config, "advantage.name", ADVANTAGES)
    _choice(errors, config, "train.loop", LOOPS)
    _choice(errors, config, "train.replay", REPLAY_MODES)
    _choice(errors, config, "optim.moment_dtype", MOMENT_DTYPES)
    try:
        mesh_rules.rules_from_config(config.mesh)
    except ValueError as e:
        errors.append(str(e))
    for key, low, low_ok, high in _BOUNDS:
        value = _get(config, key)
        if value < low or (value == low and not low_ok) or (high is not None and value > high):
            allowed = f"{'>=' if low_ok else '>'} {low}" + (f" and <= {high}" if high else "")
            errors.append(f"config.{key} must be {allowed}, got {value}")
    if config.train.steps < 0:
        errors.append(f"config.train.steps must be >= 0 (0: warm start only), got "
                      f"{config.train.steps}")
    if not 0.0 <= config.advantage.negative_scale <= 1.0:
        errors.append(f"config.advantage.negative_scale must be in [0, 1], got "
                      f"{config.advantage.negative_scale}")
    if config.train.anchor_coef < 0 or config.train.anchor_rows < 0:
        errors.append(f"config.train.anchor_coef and config.train.anchor_rows must be >= 0, got "
                      f"{config.train.anchor_coef} and {config.train.anchor_rows}")
    if config.train.anchor_coef > 0 and not config.warmstart.levels:
        errors.append("config.train.anchor_coef > 0 needs worked solutions: "
                      "config.warmstart.levels is empty")
    if config.model.causal_blocks < 1:
        errors.append(f"config.model.causal_blocks must be >= 1 (1: attention in one block), got "
                      f"{config.model.causal_blocks}")
    if config.model.attention_chunk < 0:
        errors.append(f"config.model.attention_chunk must be >= 0 (0: unchunked attention), got "
                      f"{config.model.attention_chunk}")
    if config.model.ep_chunk < 0:
        errors.append(f"config.model.ep_chunk must be >= 0 (0: one expert-parallel exchange), "
                      f"got {config.model.ep_chunk}")
    if config.model.rope_theta < 0:
        errors.append(f"config.model.rope_theta must be >= 0 (0: the preset's), got "
                      f"{config.model.rope_theta}")
    task = config.task or config.data.name
    if config.zve.tie_break.wrong_score == "step_credit" and (
            task != "arith_chains" or not config.zve.tie_break.enabled):
        errors.append("config.zve.tie_break.wrong_score='step_credit' needs worked solutions to "
                      "score steps against (task 'arith_chains') and stage 2 on "
                      f"(zve.tie_break.enabled); got task {task!r}, "
                      f"enabled={config.zve.tie_break.enabled}: for another task set "
                      "--config.zve.tie_break.wrong_score=zero")
    if config.advantage.overlong_buffer > config.rollout.max_new_tokens:
        errors.append(f"config.advantage.overlong_buffer={config.advantage.overlong_buffer} must "
                      f"be <= rollout.max_new_tokens={config.rollout.max_new_tokens}")
    if config.warmstart.max_seconds < 0:
        errors.append(f"config.warmstart.max_seconds must be >= 0 (0: no limit), got "
                      f"{config.warmstart.max_seconds}")
    if config.rollout.temperature <= 0:
        errors.append(f"config.rollout.temperature must be > 0, got {config.rollout.temperature}")
    if config.train.loop == "async" and 0 <= config.train.max_staleness < 1:
        errors.append(f"config.train.loop='async' needs config.train.max_staleness >= 1, got "
                      f"{config.train.max_staleness}: a worker samples the next batch while the "
                      "learner trains on the current one, so every group is at least one policy "
                      "version old when it is read (with 0 every group is dropped as stale)")
    if (config.mode, config.rollout.engine, config.train.loop) == ("train", "vllm", "sync"):
        errors.append("config.rollout.engine='vllm' with config.mode='train' needs "
                      "config.train.loop='async', got 'sync': the single-process loop samples "
                      "with the embedded JAX engine; vLLM runs in rollout worker processes")
    if task == "arith_chains":
        n_levels = len(config.data.levels)
        for key in ("data.train_levels", "data.eval_levels", "warmstart.levels"):
            bad = [lv for lv in _get(config, key) if not 1 <= lv <= n_levels]
            if bad:
                errors.append(f"config.{key} has levels {bad} outside 1..{n_levels} (the levels "
                              f"of config.data.levels)")
    if not errors:
        mesh = config.mesh.data * config.mesh.fsdp * config.mesh.expert * config.mesh.tensor
        one_device = mesh == 1
        axes = mesh_rules.batch_axes(mesh_rules.rules_from_config(config.mesh))
        shards = mesh_rules.batch_shards(config.mesh)
        rows = config.rollout.prompts_per_step * config.zve.n_samples
        per_update = rows // config.train.updates_per_batch
        if rows % config.train.updates_per_batch:
            errors.append(
                f"rollout rows prompts_per_step*zve.n_samples = {rows} not divisible by "
                f"train.updates_per_batch = {config.train.updates_per_batch}"
            )
        elif per_update % (config.train.micro_batches * shards):
            errors.append(
                f"rows per update {per_update} not divisible by train.micro_batches * the batch "
                f"shards ({' x '.join(f'mesh.{a}' for a in axes)} of config.mesh.rules' batch "
                f"rule) = {config.train.micro_batches} * {shards}"
            )
        elif one_device and per_update % (config.train.grad_threads
                                          * config.train.micro_batches):
            errors.append(
                f"rows per update {per_update} not divisible by train.grad_threads * "
                f"train.micro_batches = {config.train.grad_threads} * "
                f"{config.train.micro_batches} (a one-device mesh splits each update's rows "
                "into grad_threads parts)")
        if config.rollout.engine_shards and config.rollout.num_slots % config.rollout.engine_shards:
            errors.append(
                f"rollout.num_slots = {config.rollout.num_slots} not divisible by "
                f"rollout.engine_shards = {config.rollout.engine_shards} (each shard holds "
                "num_slots / engine_shards decode slots)")
        row = config.rollout.max_prompt_len + config.rollout.max_new_tokens - 1
        if config.train.pack and 0 < config.train.pack_len < row:
            errors.append(f"train.pack_len = {config.train.pack_len} is shorter than an RL row "
                          f"(rollout.max_prompt_len + max_new_tokens - 1 = {row}); 0 = {2 * row}")
        if config.train.pack and config.train.micro_batches > 1:
            errors.append(
                f"train.pack=True needs train.micro_batches == 1 (got "
                f"{config.train.micro_batches}): a packed row's sequences cannot be split "
                "across micro-batches; set train.pack=False to accumulate gradients")
        workers = config.train.num_workers
        if config.train.loop == "async" and workers > 0 and (
                config.rollout.prompts_per_step % workers):
            errors.append(
                f"rollout.prompts_per_step = {config.rollout.prompts_per_step} not divisible by "
                f"train.num_workers = {workers} (train.loop='async': each worker's batch is "
                "prompts_per_step / num_workers groups)"
            )
        anchor_rows = config.train.anchor_rows or config.warmstart.batch_size
        if config.train.anchor_coef > 0 and anchor_rows % shards:
            errors.append(
                f"anchor rows {anchor_rows} (train.anchor_rows, or warmstart.batch_size when 0) "
                f"not divisible by the batch shards ({' x '.join(f'mesh.{a}' for a in axes)} of "
                f"config.mesh.rules' batch rule) = {shards}"
            )
        elif (config.train.anchor_coef > 0 and one_device
              and anchor_rows % config.train.grad_threads):
            errors.append(
                f"anchor rows {anchor_rows} (train.anchor_rows, or warmstart.batch_size when 0) "
                f"not divisible by train.grad_threads = {config.train.grad_threads} (a one-device "
                "mesh splits the anchor's rows like the update's)")
        if mesh > n_devices:
            errors.append(
                f"mesh data*fsdp*expert*tensor = {mesh} but only {n_devices} devices are visible"
            )
    for check, key in ((validate_loss_config, "loss"), (validate_zve_config, "zve")):
        try:
            check(config[key])
        except ValueError as e:
            errors.append(f"config.{key}: {e}")
    if errors:
        raise ValueError("invalid config: " + "; ".join(errors))
