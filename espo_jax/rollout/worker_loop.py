"""The rollout worker's loop: published weights + prompts -> scored groups in the rollout buffer.

One loop for every sampler (`espo_jax.rollout.sampler`: the embedded JAX engine, vLLM): wait for
the first published weights version (`espo_jax.buffer.weights`) and check its architecture
against the run's; then per batch: wait while the learner is too far behind (flow control,
`espo_jax.rollout.worker_status`), load a newer weights version if one appeared, take the
batch's plan, generate it while the reward pool scores finished groups
(`espo_jax.rollout.generate.generate_scored_groups`), write the groups to the buffer and flush
(one shard per batch, visible at once). The predicted response lengths (for longest-first
admission) learn from every finished group.

The plan comes from a `zve.PromptScheduler` over the worker's share of the prompts (MS-ZVE
stages 0, 1 and 5 with the single-process loop's code: `next_prompts(n)`, generate,
`observe_groups`, in that order), or from a plain iterable of prompts with a fixed sample count.
With a scheduler the worker's state is committed with each batch's shard (`worker_status`).
Stage 0 (offline pruning) runs once, on the first weights the worker loads; its samples are not
written to the buffer.

On a stop (`worker_status`), with a scheduler the unfinished batch is dropped whole (a restart
regenerates it: same plan, same seed); with a plain iterable the complete groups are written.
No partial group is ever written. The worker's command line and its construction from an
experiment config: `espo_jax.rollout.worker`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from espo_jax.buffer import BufferWriter, flow, weights
from espo_jax.models.config import ModelConfig
from espo_jax.rewards.pool import RewardPool
from espo_jax.rollout import scheduling
from espo_jax.rollout.generate import generate_scored_groups
from espo_jax.rollout.sampler import JaxSampler, Sampler
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.rollout.worker_status import WorkerStatus
from espo_jax.zve import PromptScheduler, offline_pass

# Model fields a run chooses for itself (`run_setup.runtime_overrides`): not the architecture.
_RUNTIME_FIELDS = ("param_dtype", "dispatch", "remat", "attention_chunk", "causal_blocks",
                   "attention_impl", "aux_loss_coef", "aux_loss_tokens", "ep_chunk",
                   "scan_layers")
_OFFLINE_SEED = 1 << 20  # offline rounds draw from fold_in(key(seed), this + round)


class _Stopped(Exception):
    """A stop arrived while the worker was generating what it cannot write in part."""


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything a rollout worker needs besides its prompts and reward function."""

    publish_dir: str
    buffer_dir: str
    writer_id: str = "rollout-0"  # unique among live writers of buffer_dir
    n_samples: int = 4  # G responses per prompt (plain prompt iterables; a scheduler decides)
    prompts_per_batch: int = 8
    sampling: SamplingConfig = SamplingConfig()
    precision: str = "fp32"  # engine weights: fp32, bf16 or fp8
    max_slots: int = 8
    max_cache_len: int = 256
    steps_per_sync: int = 4
    prefill_rows: int = 16
    engine_shards: int = 1  # slot groups of the JAX engine, one host thread each (0: auto)
    admission: str = "longest_first"  # or "fifo"
    reward_workers: int = 2
    reward_timeout_s: float = 10.0
    reward_backend: str = "process"
    seed: int = 0  # batch b samples with fold_in(key(seed), b)
    max_batches: int | None = None  # None: until the prompts run out or a stop
    until_version: int | None = None  # stop after a batch sampled at this version or newer
    weights_timeout_s: float = 600.0  # how long to wait for the first published version
    poll_s: float = 0.5
    max_records_per_shard: int = 64
    # Flow control: the worker samples only while fewer of its shards than this are unread by
    # the learner (`flow.max_ahead`; the learner's progress file is in publish_dir, and without
    # one there is nothing to wait for); None: no flow control.
    max_ahead: int | None = None
    status_dir: str | None = None  # heartbeat status file (and scheduler state) here
    heartbeat_s: float = 5.0
    exit_with_parent: bool = False  # stop when the parent process is gone (spawned workers)


def _answer(prompt: Mapping[str, Any]) -> Any:
    return prompt["answer"]


class RolloutWorker(WorkerStatus):
    """See module doc. `prompts`: a `zve.PromptScheduler` (plans and sample counts; its state
    persists in `config.status_dir`) or an iterable of prompt dicts (`n_samples` each).
    `reward_fn(text, answer)` and `detokenize(ids)` must be importable by name (module-level)
    for the default process reward pool. `sampler`: default the JAX engine (`JaxSampler`).
    `expected_model`: the run's model config; a published version with another architecture is
    refused with an error naming the fields."""

    def __init__(
        self,
        config: WorkerConfig,
        prompts: PromptScheduler | Iterable[Mapping[str, Any]],
        reward_fn: Callable[[str, Any], Any],
        *,
        detokenize: Callable | None = None,
        log: Callable[[str], None] = print,
        target_fn: Callable[[Mapping], Any] | None = None,
        sampler: Sampler | None = None,
        expected_model: ModelConfig | None = None,
        task_name: str = "",
    ):
        c = self.config = config
        self.task_name = task_name  # named in the log when a reward fails
        self.scheduler = prompts if isinstance(prompts, PromptScheduler) else None
        self._prompts = None if self.scheduler else iter(prompts)
        self.reward_fn, self.detokenize, self.log = reward_fn, detokenize, log
        # The reward's reference per prompt: `reward_fn(text, target_fn(prompt))`; without one
        # `reward_fn` is a plain `(text, answer)` function and gets the prompt's answer.
        self.target_fn = target_fn or _answer
        self.sampler = sampler or JaxSampler(
            c.sampling, precision=c.precision, max_slots=c.max_slots,
            max_cache_len=c.max_cache_len, steps_per_sync=c.steps_per_sync,
            prefill_rows=c.prefill_rows, shards=c.engine_shards)
        self.expected_model = expected_model
        self.model_config: ModelConfig | None = None  # of the loaded weights
        self.version: int | None = None
        self.predictor = scheduling.LengthPredictor(prior_length=c.sampling.max_new_tokens)
        self.batch_index = 0  # of the next batch, over restarts (its RNG stream)
        self.offline_done = False
        self.offline_metrics: dict[str, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._state = "starting"
        self._stream: str | None = None
        self._parent = os.getppid()
        self.stats = {
            "worker/batches": 0,
            "worker/groups_written": 0,
            "worker/tokens_written": 0,
            "worker/weight_loads": 0,
            "worker/abandoned_samples": 0,
            "worker/wait_s": 0.0,
            "worker/max_ahead": 0,  # most of its batches unread by the learner after a write
        }
        self._pool: RewardPool | None = None

    # -- weights ---------------------------------------------------------------------------
    def _wait_for_weights(self) -> None:
        deadline = time.monotonic() + self.config.weights_timeout_s
        while weights.latest(self.config.publish_dir) is None:
            self._check_parent()
            if self._stop.is_set():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no weights published in {self.config.publish_dir} after "
                    f"{self.config.weights_timeout_s} s"
                )
            time.sleep(self.config.poll_s)
        self._maybe_reload()
        if self.version is None and not self._stop.is_set():
            raise RuntimeError(f"no weights version in {self.config.publish_dir} could be loaded")

    def _check_model(self, model_config: ModelConfig, where: str) -> None:
        if self.expected_model is None:
            return
        got, want = dataclasses.asdict(model_config), dataclasses.asdict(self.expected_model)
        diff = [f"{k}={got.get(k)!r} (the run's config: {want.get(k)!r})" for k in sorted(want)
                if k not in _RUNTIME_FIELDS and got.get(k) != want.get(k)]
        if diff:
            raise ValueError(f"{where}: the published weights do not match this worker's model "
                             f"config: {', '.join(diff)}; start the worker with the learner's "
                             "experiment config")

    def _maybe_reload(self) -> None:
        """Loads the newest published version if it is newer than ours."""
        for _ in range(3):  # the publisher's retention may delete a version as we read it
            found = weights.latest(self.config.publish_dir)
            if found is None or (self.version is not None and found[0] <= self.version):
                return
            try:
                where = f"{found[1]}/config.json"
                model_config = ModelConfig.from_dict(weights.load_config(found[1]), where)
                self._check_model(model_config, where)
                self.sampler.load(found[0], found[1], model_config)
            except FileNotFoundError:
                if found[1].exists():  # not retention: the version lacks what the sampler needs
                    raise
                continue
            self.model_config = model_config
            self.version = found[0]
            self.stats["worker/weight_loads"] += 1
            self.log(f"loaded weights version {found[0]} ({self.sampler.sampler_name})")
            return

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        """Runs until the prompts run out, `max_batches`, a stop, or the learner is done;
        returns the counters."""
        c = self.config
        if c.status_dir is not None:
            os.makedirs(c.status_dir, exist_ok=True)
        self._write_status()
        self._wait_for_weights()
        self._restore()
        writer = BufferWriter(c.buffer_dir, c.writer_id,
                              max_records_per_shard=max(c.max_records_per_shard,
                                                        c.prompts_per_batch))
        self._stream = writer.stream
        pool = self._pool = RewardPool(
            self.reward_fn,
            num_workers=c.reward_workers,
            timeout_s=c.reward_timeout_s,
            backend=c.reward_backend,
            detokenize=self.detokenize,
        )
        beat_done = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(beat_done,), daemon=True)
        beat.start()
        try:
            if self.scheduler is not None and not self.offline_done and not self._stop.is_set():
                self._offline(pool)
            for b in itertools.count():
                if self._stop.is_set() or (c.max_batches is not None and b >= c.max_batches):
                    break
                self._wait_for_learner(writer)
                if self._stop.is_set():
                    break
                plan = self._plan()
                if not plan:
                    break
                self._maybe_reload()  # after the plan: the newest weights sample it
                self._set_state("sampling")
                if not self._run_batch(plan, pool, writer):
                    break
                if c.until_version is not None and self.version >= c.until_version:
                    break
        except _Stopped:
            pass
        finally:
            beat_done.set()
            writer.close()
            pool.close(wait_pending=False)
            self._set_state("done")
            self._write_status()
        stats = {k: float(v) for k, v in self.stats.items()}
        stats.update(pool.metrics())
        stats["worker/policy_version"] = float(self.version if self.version is not None else -1)
        self.log(f"rollout worker done: {stats}")
        return stats

    def _plan(self) -> list[tuple[Mapping, int]]:
        n = self.config.prompts_per_batch
        if self.scheduler is not None:
            return self.scheduler.next_prompts(n)
        return [(p, self.config.n_samples) for p in itertools.islice(self._prompts, n)]

    def _generate(self, plan, pool: RewardPool, seed: int):
        return generate_scored_groups(
            self.sampler, pool, plan,
            rng=jax.random.fold_in(jax.random.key(self.config.seed), seed),
            policy_version=self.version, n_experts=self.sampler.n_experts,
            admission=self.config.admission, predictor=self.predictor,
            target_fn=self.target_fn, meta={"worker": self.config.writer_id},
            task=self.task_name)

    def _offline(self, pool: RewardPool) -> None:
        """MS-ZVE stage 0 over this worker's prompts with the weights it loaded first."""
        rounds = itertools.count()

        def draw(plan):
            self._set_state("offline")
            groups = self._generate(plan, pool, _OFFLINE_SEED + next(rounds))
            if len(groups) < len(plan):
                raise _Stopped
            return groups

        pruned, metrics = offline_pass(self.scheduler, draw)
        self.offline_done, self.offline_metrics = True, metrics
        if metrics:
            self.log(f"offline pass (v{self.version}): pruned {len(pruned)} of "
                     f"{len(self.scheduler.prompts)} prompts, "
                     f"{int(metrics['zve/offline_tokens'])} tokens")
        self._save()

    def _run_batch(self, plan, pool: RewardPool, writer: BufferWriter) -> bool:
        """Generates, scores and writes one batch; False when a stop cut it short."""
        c, b = self.config, self.batch_index
        self.log(f"batch {b}: generating {len(plan)} prompts "
                 f"({sum(n for _, n in plan)} samples, weights v{self.version})")
        groups = self._generate(plan, pool, b)
        abandoned = int(self.sampler.last_stats.get("engine/abandoned_samples", 0))
        self.stats["worker/abandoned_samples"] += abandoned
        complete = len(groups) == len(plan)
        if not complete and self.scheduler is not None:
            self.log(f"batch {b}: stopped; dropped the unfinished batch ({len(groups)} of "
                     f"{len(plan)} groups complete, {abandoned} samples in flight): a restart "
                     "regenerates it")
            return False
        for g in groups:
            writer.write(g)
            self.predictor.observe(g.prompt_id, [r.length for r in g.responses])
        self.batch_index += 1
        if self.scheduler is not None and groups:
            self.scheduler.observe_groups(groups)
            self.scheduler.pop_metrics()  # per-batch counters: the totals go in the status
            pending = self._state_paths()[1] if c.status_dir is not None else None
            if pending is not None:  # staged with its shard (`worker_status` doc)
                flow.write_json(pending, {"stream": writer.stream,
                                          "shard_index": len(writer.shards_written),
                                          "state": self._snapshot()})
            writer.flush()
            if pending is not None:
                flow.write_json(self._state_paths()[0], self._snapshot())
                pending.unlink(missing_ok=True)
        else:
            writer.flush()
        if c.max_ahead is not None:  # what flow control allows, as measured after each write
            self.stats["worker/max_ahead"] = max(self.stats["worker/max_ahead"],
                                                 self._ahead(writer))
        tokens = int(sum(np.sum(g.response_lengths) for g in groups))
        self.stats["worker/batches"] += 1
        self.stats["worker/groups_written"] += len(groups)
        self.stats["worker/tokens_written"] += tokens
        self._write_status()
        if not complete:
            self.log(f"batch {b}: stopped; wrote {len(groups)} of {len(plan)} groups, "
                     f"dropped {abandoned} samples in flight")
            return False
        tps = self.sampler.last_stats.get("engine/tokens_per_s", 0.0)
        self.log(f"batch {b}: wrote {len(groups)} groups ({tps:.0f} tok/s)")
        return True


