"""The rollout worker: published weights + prompts -> scored groups in the rollout buffer.

One loop for every sampler (`espo_jax.rollout.sampler`: the embedded JAX engine, vLLM): wait for
the first published weights version (`espo_jax.buffer.weights`) and check its architecture
against the run's; then per batch: wait while the learner is too far behind (flow control,
`espo_jax.buffer.flow`), load a newer weights version if one appeared, take the batch's plan,
generate it while the reward pool scores finished groups
(`espo_jax.rollout.generate.generate_scored_groups`), write the groups to the buffer and flush
(one shard per batch, visible at once). The predicted response lengths (for longest-first
admission) learn from every finished group.

The plan comes from a `zve.PromptScheduler` over the worker's share of the prompts (MS-ZVE
stages 0, 1 and 5 with the single-process loop's code: `next_prompts(n)`, generate,
`observe_groups`, in that order), or from a plain iterable of prompts with a fixed sample count.
With a scheduler the worker keeps its state (scheduler, batch index, length predictor) in
`state_dir`, committed together with each batch's shard: a pending state is written before the
flush and made current after it, and a restarted worker takes the pending one only if its shard
reached the buffer (`flow.shard_durable`), so no prompt's group is lost or written twice.
Stage 0 (offline pruning) runs once, on the first weights the worker loads; its samples are not
written to the buffer.

Stopping: SIGTERM / SIGINT (or `request_stop()`) make the sampler return at its next sync with
only the groups already complete. With a scheduler the unfinished batch is dropped whole (a
restart regenerates it: same plan, same seed); with a plain iterable the complete groups are
written. No partial group is ever written. A worker stops by itself when the learner's progress
file says the run is done, or (`exit_with_parent`) when the process that started it is gone.
A heartbeat thread rewrites the worker's status file (`flow.status_path`) every few seconds:
state, weights version, counters, the scheduler's totals; the learner reads it for its health
metrics and to see which workers are live. The same code runs in-process or as its own process,
built from an experiment config (`main_from_config`):

    python -m espo_jax.rollout.worker --config experiments/<name>.py --workdir W

(the same as `python -m espo_jax.main ... --config.mode=rollout --config.rollout.engine=jax`).
Weights from W/weights, groups to `config.buffer.dir` or W/buffer, status and state in
W/workers; the flags, the same for the vLLM worker (`espo_jax.rollout.vllm_cli`), are in
`espo_jax.rollout.worker_flags`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from espo_jax import run_setup, tasks
from espo_jax.buffer import BufferWriter, flow, weights
from espo_jax.models.config import ModelConfig
from espo_jax.rewards.pool import RewardPool
from espo_jax.rollout import scheduling
from espo_jax.rollout.generate import generate_scored_groups
from espo_jax.rollout.sampler import JaxSampler, Sampler
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.zve import PromptScheduler, offline_pass
from espo_jax.zve.status import ACTIVE, PRUNED, RETIRED

# Model fields a run chooses for itself (`run_setup.runtime_overrides`): not the architecture.
_RUNTIME_FIELDS = ("dispatch", "remat", "attention_chunk", "causal_blocks", "aux_loss_coef",
                   "aux_loss_tokens")
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


class RolloutWorker:
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

    # -- control ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Finish cleanly: complete groups are written, samples in flight dropped."""
        self._stop.set()
        self.sampler.request_stop()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT call `request_stop` (main thread only)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.request_stop())

    def _check_parent(self) -> None:
        if self.config.exit_with_parent and os.getppid() != self._parent:
            if not self._stop.is_set():
                self.log("the process that started this worker is gone: stopping")
            self.request_stop()

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

    # -- flow control and status -------------------------------------------------------------
    def _ahead(self, writer: BufferWriter) -> int:
        """This worker's shards the learner has not read; 0 without a learner's progress file
        (weights published by hand: nothing to wait for)."""
        progress = flow.read_progress(self.config.publish_dir)
        if progress is None:
            return 0
        if progress.get("done"):
            if not self._stop.is_set():
                self.log("the learner's run is done: stopping")
            self._stop.set()
        return len(writer.shards_written) - flow.shards_read(progress, writer.stream)

    def _wait_for_learner(self, writer: BufferWriter) -> None:
        """Flow control: waits while this worker is `max_ahead` unread shards ahead."""
        c = self.config
        if c.max_ahead is None:
            return
        start, logged = time.monotonic(), False
        while (ahead := self._ahead(writer)) >= c.max_ahead and not self._stop.is_set():
            if not logged:
                self.log(f"waiting for the learner: {ahead} batches written and not read yet "
                         f"(at most {c.max_ahead})")
                logged = True
            self._set_state("waiting")
            self._check_parent()
            time.sleep(c.poll_s)
        self.stats["worker/wait_s"] += time.monotonic() - start

    def _set_state(self, state: str) -> None:
        with self._lock:
            self._state = state

    def status(self) -> dict[str, Any]:
        """What the status file holds (module doc)."""
        with self._lock:
            status = {"writer_id": self.config.writer_id, "stream": self._stream,
                      "pid": os.getpid(), "host": socket.gethostname(), "state": self._state,
                      "updated_at": time.time(), "policy_version": self.version,
                      "sampler": self.sampler.sampler_name, **self.stats}
            if self._pool is not None:
                status.update(self._pool.metrics())
            if self.scheduler is not None:  # stages 0, 1, 5: counts now, and totals
                sched = self.scheduler
                status["zve"] = {
                    **{f"zve/{s}": float(sched.status.count(s)) for s in (ACTIVE, RETIRED, PRUNED)},
                    **{f"zve/{k}_total": float(v) for k, v in sched.totals.items()},
                    **self.offline_metrics}
        return status

    def _write_status(self) -> None:
        if self.config.status_dir is not None:
            flow.write_json(flow.status_path(self.config.status_dir, self.config.writer_id),
                            self.status())

    def _heartbeat(self, done: threading.Event) -> None:
        while not done.wait(self.config.heartbeat_s):
            self._check_parent()
            try:
                self._write_status()
            except OSError as e:  # a full disk or a flaky bucket must not kill the worker
                self.log(f"status file not written: {e}")

    # -- scheduler state ---------------------------------------------------------------------
    def _state_paths(self):
        base = flow.status_path(self.config.status_dir, self.config.writer_id)
        return base.with_suffix(".state.json"), base.with_suffix(".pending.json")

    def _snapshot(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "batch_index": self.batch_index,
                "predictor": self.predictor.state_dict(), "offline_done": self.offline_done,
                "offline_metrics": self.offline_metrics}

    def _restore(self) -> None:
        """The state of the last batch that reached the buffer (module doc)."""
        if self.scheduler is None or self.config.status_dir is None:
            return
        current, pending = self._state_paths()
        state = flow.read_json(current)
        staged = flow.read_json(pending)
        if staged is not None:
            progress = flow.read_progress(self.config.publish_dir)
            if flow.shard_durable(self.config.buffer_dir, progress, staged["stream"],
                                  staged["shard_index"]):
                state = staged["state"]
                flow.write_json(current, state)
            pending.unlink(missing_ok=True)
        if state is None:
            return
        self.scheduler.load_state_dict(state["scheduler"])
        self.batch_index = int(state["batch_index"])
        self.predictor = scheduling.LengthPredictor.from_state_dict(state["predictor"])
        self.offline_done = bool(state["offline_done"])
        self.offline_metrics = dict(state["offline_metrics"])
        self.log(f"resumed the prompt scheduler at batch {self.batch_index} "
                 f"(epoch {self.scheduler.epoch})")

    def _save(self) -> None:
        if self.scheduler is not None and self.config.status_dir is not None:
            flow.write_json(self._state_paths()[0], self._snapshot())

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
            if pending is not None:  # staged with the shard it belongs to (module doc)
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


# ---- entry points ---------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """`python -m espo_jax.rollout.worker`: the flags of `espo_jax.rollout.worker_flags`."""
    from absl import app

    from espo_jax import config_validation
    from espo_jax.rollout import worker_flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config, workdir = worker_flags.CONFIG.value, worker_flags.WORKDIR.value
    jax.config.update("jax_compilation_cache_dir",  # the main job's cache (espo_jax.main)
                      os.path.expanduser("~/.cache/espo_jax/jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    config_validation.validate(config, n_devices=jax.device_count())
    os.makedirs(workdir, exist_ok=True)
    return main_from_config(config, workdir, **worker_flags.worker_args())


def main_from_config(config, workdir: str, index: int = 0, num_workers: int = 1, *,
                     max_batches: int | None = None, until_version: int | None = None,
                     stats: str | None = None, sampler: Sampler | None = None,
                     exit_with_parent: bool = False, log_path: str | None = None) -> int:
    """A worker built from an experiment config (`python -m espo_jax.main --mode=rollout`, the
    async loop's worker processes, `python -m espo_jax.rollout.worker`, and with a
    `vllm_worker.VllmSampler` the vLLM worker).

    Weights from WORKDIR/weights (where the learner publishes), groups to the configured buffer
    (default WORKDIR/buffer), status and scheduler state in WORKDIR/workers. Worker `index` of
    `num_workers` runs a `PromptScheduler` (`config.zve`: stages 0, 1, 5) over every
    `num_workers`-th training prompt from the `index`-th, `rollout.prompts_per_step //
    num_workers` prompts per batch, its own RNG stream: workers never duplicate each other's
    groups. Flow control from `train.max_staleness` and `rollout.max_inflight_batches`. It
    stops after `max_batches`, after a batch sampled at policy version >= `until_version`, when
    the learner is done, or on SIGTERM; `stats`: a JSON file for the run's counters.
    """
    r = config.rollout
    if r.prompts_per_step % num_workers:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by "
                         f"the {num_workers} workers (each samples prompts_per_step / "
                         "num_workers prompts per batch)")
    tokenizer = run_setup.load_run_tokenizer(config)
    task, train, *_ = run_setup.prompt_sets(config, workdir, tokenizer)
    mine = run_setup.worker_share(train, index, num_workers)
    scheduler = PromptScheduler(mine, config.zve, seed=config.seed * 1000 + index)
    sampling = SamplingConfig(r.temperature, r.top_k, r.top_p, r.max_new_tokens,
                              (tokenizer.eos_id,))
    wc = WorkerConfig(
        publish_dir=os.path.join(workdir, "weights"),
        buffer_dir=config.buffer.dir or os.path.join(workdir, "buffer"),
        writer_id=f"{'vllm' if sampler is not None else 'rollout'}-{index}",
        n_samples=config.zve.n_samples,
        prompts_per_batch=r.prompts_per_step // num_workers,
        sampling=sampling,
        precision=r.precision,
        max_slots=r.num_slots,
        steps_per_sync=r.steps_per_sync,
        prefill_rows=r.prefill_rows,
        engine_shards=r.engine_shards,
        max_cache_len=r.max_prompt_len + r.max_new_tokens,
        reward_workers=r.reward_workers,
        reward_timeout_s=r.reward_timeout_s,
        reward_backend=r.reward_backend,
        seed=config.seed * 1000 + index,
        max_batches=max_batches,
        until_version=until_version,
        max_ahead=flow.max_ahead(config.train.max_staleness, r.max_inflight_batches),
        status_dir=os.path.join(workdir, "workers"),
        exit_with_parent=exit_with_parent,
    )
    reward, target_fn = tasks.reward_fn(task)
    if log_path:  # a worker the learner spawned: its lines go to a file, not the console
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        log_file = open(log_path, "a")  # noqa: SIM115 (open for the worker's lifetime)
        log = functools.partial(print, file=log_file, flush=True)
    else:
        log = functools.partial(print, flush=True)
    log(f"rollout worker {index} of {num_workers}: {len(mine)} prompts, "
        f"{wc.prompts_per_batch} per batch, at most {wc.max_ahead} batches ahead of the learner")
    worker = RolloutWorker(wc, scheduler, reward, detokenize=tasks.decoder(config, tokenizer),
                           target_fn=target_fn, log=log, sampler=sampler, task_name=task.name,
                           expected_model=run_setup.model_architecture(config))
    worker.install_signal_handlers()
    counters = worker.run()
    if stats:
        import json

        with open(stats, "w") as f:
            json.dump(counters, f)
    return 0


if __name__ == "__main__":
    from absl import app, flags

    from espo_jax import host_memory
    from espo_jax.rollout import worker_flags

    host_memory.reexec_with_huge_pages()  # glibc's huge pages for XLA's buffers (a restart)

    flags.adopt_module_key_flags(worker_flags)  # --help lists them
    app.run(main)
