"""What a run is built from: model config, tokenizer, prompt sets, mesh (`build` -> `RunSetup`).

Neutral ground between the learner (`espo_jax.train`) and the rollout workers
(`espo_jax.rollout.worker`): both build their run from the same config here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np

from espo_jax import distributed, mesh_rules, sharding, task_prompts, tasks
from espo_jax.buffer import flow
from espo_jax.models import hf_io, scan
from espo_jax.models.config import ModelConfig
from espo_jax.models.presets import get_preset
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.rollout.worker_loop import WorkerConfig
from espo_jax.tokenizer import load_tokenizer
from espo_jax.zve import PromptScheduler


@dataclasses.dataclass
class RunSetup:
    config: ml_collections.ConfigDict
    workdir: str
    model_config: ModelConfig
    tokenizer: object
    mesh: jax.sharding.Mesh
    rules: mesh_rules.Rules  # config.mesh.rules: logical axis names -> mesh axes
    task: tasks.Task  # config.task: its reward and raw prompt splits
    train_prompts: Sequence[dict]  # RL prompts (all train levels)
    warm_prompts: Sequence[dict]  # warm-start prompts (the easy levels)
    eval_prompts: Sequence[dict]  # held-out prompts of config.eval.split
    hf_params: dict | None = None  # initial weights from a Hugging Face directory
    test_prompts: Sequence[dict] = ()  # with eval.final_test: test prompts for the end


def balanced_subset(prompts: Sequence[dict], n: int, seed: int) -> list[dict]:
    """`n` prompts spread evenly over levels (round robin over a seeded shuffle per level)."""
    rng = np.random.default_rng(seed)
    by_level: dict[int, list[int]] = {}
    for i in range(len(prompts)):
        by_level.setdefault(int(prompts[i].get("level", 0)), []).append(i)
    queues = [list(rng.permutation(ids)) for _, ids in sorted(by_level.items())]
    picked: list[int] = []
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(int(q.pop(0)))
    return [prompts[i] for i in sorted(picked)]


def prompt_sets(config: ml_collections.ConfigDict, workdir: str, tokenizer
                ) -> tuple[tasks.Task, Sequence[dict], Sequence[dict], list[dict], list[dict]]:
    """(task, RL pool, warm-start prompts, evaluation prompts, final test prompts) of a run: the
    task's sources, the RL pool cut to `data.rl_prompts`, the evaluation set (split
    `eval.split`) to `eval.num_prompts`, spread over levels, and with `eval.final_test` (and
    split "validation") as many test prompts (else none). Every worker and the learner see the
    same lists."""
    task, splits = task_prompts.prompt_sources(config, workdir, tokenizer)
    train = splits["train"]
    if not len(train):
        raise ValueError(f"task {task.name!r} has no train prompts")
    if config.data.rl_prompts:
        train = balanced_subset(train, config.data.rl_prompts, seed=config.seed)
    held_out = splits[config.eval.split]
    if not len(held_out):
        raise ValueError(f"task {task.name!r} has no {config.eval.split} prompts "
                         f"(config.eval.split={config.eval.split!r})")
    if config.warmstart.steps > 0 or config.train.anchor_coef > 0:
        if not all(splits["warm"][i]["solution"] for i in range(min(len(splits["warm"]), 8))):
            raise ValueError(f"task {task.name!r}: warmstart.steps > 0 or train.anchor_coef > 0 "
                             "needs worked solutions (a 'solution' field) in its warm-start "
                             "prompts; set --config.warmstart.steps=0 --config.train.anchor_coef"
                             "=0")
    eval_prompts = balanced_subset(held_out, config.eval.num_prompts, seed=config.seed)
    test: list[dict] = []
    if config.eval.final_test and config.eval.split != "test":
        if not len(splits["test"]):
            raise ValueError(f"task {task.name!r} has no test prompts (config.eval.final_test)")
        test = balanced_subset(splits["test"], config.eval.num_prompts, seed=config.seed)
    return task, train, splits["warm"], eval_prompts, test


def worker_share(prompts: Sequence[dict], index: int, num_workers: int) -> list[dict]:
    """Rollout worker `index` of `num_workers`'s prompts: every `num_workers`-th from the
    `index`-th, so workers share none and together cover all; a worker left with none is an
    error naming the numbers."""
    mine = [prompts[i] for i in range(index, len(prompts), num_workers)]
    if not mine:
        raise ValueError(f"worker {index} of {num_workers}: no training prompts for it (the "
                         f"training set has {len(prompts)})")
    return mine


def sampling_config(config: ml_collections.ConfigDict, stop_tokens: Sequence[int]
                    ) -> SamplingConfig:
    """How every sampler of the run samples (`config.rollout`), stopping at `stop_tokens`."""
    r = config.rollout
    return SamplingConfig(r.temperature, r.top_k, r.top_p, r.max_new_tokens, tuple(stop_tokens))


@dataclasses.dataclass
class WorkerSetup:
    """What a rollout worker is built from (`build_worker`), as `RunSetup` is the learner's."""
    worker_config: WorkerConfig
    scheduler: PromptScheduler  # over the worker's share of the RL prompts
    task: tasks.Task
    tokenizer: object
    prompts: Sequence[dict]  # the worker's share
    expected_model: ModelConfig  # the architecture the published weights must have


def build_worker(config: ml_collections.ConfigDict, workdir: str, index: int = 0,
                 num_workers: int = 1, *, writer: str = "rollout", **loop_args) -> WorkerSetup:
    """Rollout worker `index` of `num_workers`: its prompts (`worker_share` of the RL pool),
    its scheduler and RNG stream (seed * 1000 + index), and its `WorkerConfig`: weights from
    WORKDIR/weights, groups to `buffer.dir` or WORKDIR/buffer as `{writer}-{index}`, status in
    WORKDIR/workers, flow control from `train.max_staleness` and
    `rollout.max_inflight_batches`; `loop_args`: the loop's own (`max_batches`,
    `until_version`, `exit_with_parent`)."""
    r = config.rollout
    if r.prompts_per_step % num_workers:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by "
                         f"the {num_workers} workers (each samples prompts_per_step / "
                         "num_workers prompts per batch)")
    tokenizer = load_run_tokenizer(config)
    task, train, *_ = prompt_sets(config, workdir, tokenizer)
    mine = worker_share(train, index, num_workers)
    seed = config.seed * 1000 + index
    wc = WorkerConfig(
        publish_dir=os.path.join(workdir, "weights"),
        buffer_dir=config.buffer.dir or os.path.join(workdir, "buffer"),
        writer_id=f"{writer}-{index}",
        n_samples=config.zve.n_samples,
        prompts_per_batch=r.prompts_per_step // num_workers,
        sampling=sampling_config(config, (tokenizer.eos_id,)),
        precision=r.precision,
        max_slots=r.num_slots,
        steps_per_sync=r.steps_per_sync,
        prefill_rows=r.prefill_rows,
        engine_shards=r.engine_shards,
        max_cache_len=r.max_prompt_len + r.max_new_tokens,
        reward_workers=r.reward_workers,
        reward_timeout_s=r.reward_timeout_s,
        reward_backend=r.reward_backend,
        seed=seed,
        max_ahead=flow.max_ahead(config.train.max_staleness, r.max_inflight_batches),
        status_dir=os.path.join(workdir, "workers"),
        **loop_args,
    )
    return WorkerSetup(wc, PromptScheduler(mine, config.zve, seed=seed), task, tokenizer, mine,
                       model_architecture(config))


# The learner's parameters: float32 masters whatever the checkpoint holds (`train/state.py`
# says why). Rollout engines and published versions get them in their own precision.
MASTER_DTYPE = "float32"


def preset_model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """`config.model.preset` with the config's overrides (rope_theta when > 0; see
    `runtime_overrides` for the rest)."""
    overrides = {"rope_theta": float(config.model.rope_theta)} if config.model.rope_theta else {}
    return get_preset(config.model.preset, **overrides, **runtime_overrides(config))


def runtime_overrides(config: ml_collections.ConfigDict) -> dict:
    """The model fields a run chooses whatever the weights' architecture (a preset's or a
    Hugging Face config.json's): the parameters' dtype (`MASTER_DTYPE`; the compute dtype stays
    the model's), MoE dispatch and its exchange chunk, layer remat and scan, attention chunk
    and blocks, the aux losses' positions, and the load-balancing loss weight when
    `config.model.aux_loss_coef` >= 0."""
    overrides = {"param_dtype": MASTER_DTYPE,
                 "dispatch": config.model.dispatch, "remat": bool(config.model.remat),
                 "scan_layers": bool(config.model.scan_layers),
                 "attention_chunk": int(config.model.attention_chunk),
                 "ep_chunk": int(config.model.ep_chunk),
                 "causal_blocks": int(config.model.causal_blocks),
                 "aux_loss_tokens": config.model.aux_loss_tokens}
    if config.model.aux_loss_coef >= 0:
        overrides["aux_loss_coef"] = float(config.model.aux_loss_coef)
    return overrides


def model_dir(config: ml_collections.ConfigDict) -> str:
    """The Hugging Face directory of `config.model.hf_path`: itself, or for a `.gguf` file its
    converted copy in the cache (converted on first use; `espo_jax.models.gguf`)."""
    path = config.model.hf_path
    if path.endswith(".gguf"):
        from espo_jax.models import gguf

        return gguf.cached_convert(path)
    return path


def load_run_tokenizer(config: ml_collections.ConfigDict):
    """`config.tokenizer`: "char", a tokenizer path, or "model" for the tokenizer of the model's
    own directory (`model_dir`)."""
    if config.tokenizer == "model":
        if not config.model.hf_path:
            raise ValueError("config.tokenizer='model' needs config.model.hf_path")
        return load_tokenizer(model_dir(config))
    return load_tokenizer(config.tokenizer)


def load_model(config: ml_collections.ConfigDict) -> tuple[ModelConfig, dict | None]:
    """(model config, Hugging Face weights or None): `config.model.hf_path`'s architecture and
    weights when set (in the layout `config.model.scan_layers` asks for), else the preset's
    architecture; the run's `runtime_overrides` either way."""
    if not config.model.hf_path:
        return preset_model_config(config), None
    model_config, hf_params = hf_io.from_pretrained(model_dir(config))
    model_config = model_config.replace(**runtime_overrides(config))
    master = np.dtype(MASTER_DTYPE)
    return model_config, scan.stack(model_config, jax.tree.map(lambda x: x.astype(master),
                                                               hf_params))


def model_architecture(config: ml_collections.ConfigDict) -> ModelConfig:
    """The run's model config as `load_model` gives it, without reading any weights (a rollout
    worker checks the published versions against it)."""
    if not config.model.hf_path:
        return preset_model_config(config)
    with open(os.path.join(model_dir(config), "config.json")) as f:
        return hf_io.config_from_hf(json.load(f)).replace(**runtime_overrides(config))


def abstract_params(config: ml_collections.ConfigDict) -> dict:
    """The shapes and dtypes of the run's model parameters (`jax.ShapeDtypeStruct`s), from the
    architecture alone: nothing is read or allocated."""
    from espo_jax.models import init_params

    return jax.eval_shape(functools.partial(init_params, model_architecture(config)),
                          jax.random.key(0))


def build(config: ml_collections.ConfigDict, workdir: str) -> RunSetup:
    """Everything but the train state, the cheap checks first: the architecture (a Hugging Face
    config.json, no weights) against the tokenizer and the loss, the mesh, then the task (its
    reward tried once, `task_prompts.check_reward`) and its prompts; the weights last."""
    model_config = model_architecture(config)
    tokenizer = load_run_tokenizer(config)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size "
                         f"is {model_config.vocab_size}")
    if config.loss.name == "espo" and config.loss.vocab_size != model_config.vocab_size:
        raise ValueError(f"config.loss.vocab_size={config.loss.vocab_size} must equal the "
                         f"model's vocab_size={model_config.vocab_size} (ESPO's log|V|)")
    n_mesh = config.mesh.data * config.mesh.fsdp * config.mesh.expert * config.mesh.tensor
    mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[:n_mesh])
    rules = mesh_rules.rules_from_config(config.mesh)
    sharding.validate_divisibility(model_config, mesh, rules)
    if not distributed.is_primary():  # process 0 prepares the TFDS data, the others wait
        distributed.sync("prompt_sources")
    task, train, warm, eval_prompts, test = prompt_sets(config, workdir, tokenizer)
    if distributed.is_primary():
        distributed.sync("prompt_sources")
    hf_params = load_model(config)[1]
    return RunSetup(config, workdir, model_config, tokenizer, mesh, rules, task, train, warm,
                    eval_prompts, hf_params, test)
