"""The rollout worker: published weights + prompts -> scored groups in the rollout buffer.

Loop: wait for the first published weights version (`espo_jax.buffer.weights`), then per
batch: take `prompts_per_batch` prompts from the prompt iterator, load a newer weights version if
one appeared, generate `n_samples` responses per prompt with the embedded engine while the reward
pool scores finished groups (`espo_jax.rollout.generate.generate_scored_groups`), write the
groups to the buffer in prompt order and flush (the shard becomes visible). The predicted
response lengths (for longest-first admission) learn from every finished group.

Stopping: SIGTERM / SIGINT (or `request_stop()`) make the engine return at its next sync with
only the groups already complete; those are scored, written and flushed, the samples in flight
are dropped (no partial group is ever written) and `run` returns. The same code runs in-process
(the single-process loop can drive a `RolloutWorker`) or as its own process, built from an
experiment config (`main_from_config`):

    python -m espo_jax.rollout.worker --config experiments/<name>.py --workdir W

(the same as `python -m espo_jax.main ... --config.mode=rollout --config.rollout.engine=jax`).
Weights from W/weights, groups to `config.buffer.dir` or W/buffer; the flags, the same for the
vLLM worker (`espo_jax.rollout.vllm_cli`), are in `espo_jax.rollout.worker_flags`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from espo_jax import run_setup, tasks
from espo_jax.buffer import BufferWriter, weights
from espo_jax.models.config import ModelConfig
from espo_jax.rewards.pool import RewardPool
from espo_jax.rollout import scheduling
from espo_jax.rollout.engine import Engine
from espo_jax.rollout.generate import generate_scored_groups
from espo_jax.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything a rollout worker needs besides its prompts and reward function."""

    publish_dir: str
    buffer_dir: str
    writer_id: str = "rollout-0"  # unique among live writers of buffer_dir
    n_samples: int = 4  # G responses per prompt
    prompts_per_batch: int = 8
    sampling: SamplingConfig = SamplingConfig()
    precision: str = "fp32"  # engine weights: fp32, bf16 or fp8
    max_slots: int = 8
    max_cache_len: int = 256
    steps_per_sync: int = 4
    prefill_rows: int = 16
    admission: str = "longest_first"  # or "fifo"
    reward_workers: int = 2
    reward_timeout_s: float = 10.0
    reward_backend: str = "process"
    seed: int = 0  # batch b samples with fold_in(key(seed), b)
    max_batches: int | None = None  # None: until the prompts run out or a stop
    weights_timeout_s: float = 600.0  # how long to wait for the first published version
    poll_s: float = 0.5
    max_records_per_shard: int = 64


class RolloutWorker:
    """See module doc. `reward_fn(text, answer)` and `detokenize(ids)` must be importable by
    name (module-level) for the default process reward pool."""

    def __init__(
        self,
        config: WorkerConfig,
        prompts: Iterable[Mapping[str, Any]],
        reward_fn: Callable[[str, Any], Any],
        *,
        detokenize: Callable | None = None,
        log: Callable[[str], None] = print,
        target_fn: Callable[[Mapping], Any] | None = None,
    ):
        self.config = config
        self._prompts = iter(prompts)
        self.reward_fn, self.detokenize, self.log = reward_fn, detokenize, log
        self.target_fn = target_fn  # the reward's reference per prompt (default its answer)
        self.engine: Engine | None = None
        self.model_config = None  # of the loaded weights
        self.n_experts: int | None = None
        self.version: int | None = None
        self.predictor = scheduling.LengthPredictor(prior_length=config.sampling.max_new_tokens)
        self._stop = threading.Event()
        self.stats = {
            "worker/batches": 0,
            "worker/groups_written": 0,
            "worker/weight_loads": 0,
            "worker/abandoned_samples": 0,
        }

    # -- control ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Finish cleanly: complete groups are written, samples in flight dropped."""
        self._stop.set()
        if self.engine is not None:
            self.engine.request_stop()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT call `request_stop` (main thread only)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.request_stop())

    # -- weights ---------------------------------------------------------------------------
    def _wait_for_weights(self) -> None:
        deadline = time.monotonic() + self.config.weights_timeout_s
        while weights.latest(self.config.publish_dir) is None:
            if self._stop.is_set():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no weights published in {self.config.publish_dir} after "
                    f"{self.config.weights_timeout_s} s"
                )
            time.sleep(self.config.poll_s)
        self._maybe_reload()

    def _maybe_reload(self) -> None:
        """Loads the newest published version if it is newer than ours."""
        for _ in range(3):  # the publisher's retention may delete a version as we read it
            found = weights.latest(self.config.publish_dir)
            if found is None or (self.version is not None and found[0] <= self.version):
                return
            try:
                raw, params = weights.load(found[1])
                model_config = ModelConfig.from_dict(raw, f"{found[1]}/config.json")
            except FileNotFoundError:
                continue
            c = self.config
            if model_config != self.model_config:  # first load, or a new architecture
                self.model_config = model_config
                self.engine = Engine(
                    model_config,
                    sampling=c.sampling,
                    max_slots=c.max_slots,
                    max_cache_len=c.max_cache_len,
                    precision=c.precision,
                    steps_per_sync=c.steps_per_sync,
                    prefill_rows=c.prefill_rows,
                )
                if self._stop.is_set():
                    self.engine.request_stop()
            self.engine.load_params(params)
            self.n_experts = model_config.n_experts if model_config.n_moe_layers else None
            self.version = found[0]
            self.stats["worker/weight_loads"] += 1
            self.log(f"loaded weights version {found[0]} ({self.engine.sampler_name})")
            return

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        """Runs until the prompts run out, `max_batches`, or a stop; returns the counters."""
        c = self.config
        self._wait_for_weights()
        writer = BufferWriter(
            c.buffer_dir, c.writer_id, max_records_per_shard=c.max_records_per_shard
        )
        pool = RewardPool(
            self.reward_fn,
            num_workers=c.reward_workers,
            timeout_s=c.reward_timeout_s,
            backend=c.reward_backend,
            detokenize=self.detokenize,
        )
        try:
            for b in itertools.count():
                if self._stop.is_set() or (c.max_batches is not None and b >= c.max_batches):
                    break
                batch = list(itertools.islice(self._prompts, c.prompts_per_batch))
                if not batch:
                    break
                self._maybe_reload()
                self._run_batch(b, batch, pool, writer)
        finally:
            writer.close()
            pool.close(wait_pending=False)
        stats = {k: float(v) for k, v in self.stats.items()}
        stats.update(pool.metrics())
        stats["worker/policy_version"] = float(self.version if self.version is not None else -1)
        self.log(f"rollout worker done: {stats}")
        return stats

    def _run_batch(
        self, b: int, batch: list[Mapping], pool: RewardPool, writer: BufferWriter
    ) -> None:
        c = self.config
        self.log(
            f"batch {b}: generating {len(batch)} prompts x {c.n_samples} (weights v{self.version})"
        )
        groups = generate_scored_groups(
            self.engine,
            pool,
            [(p, c.n_samples) for p in batch],
            rng=jax.random.fold_in(jax.random.key(c.seed), b),
            policy_version=self.version,
            n_experts=self.n_experts,
            admission=c.admission,
            predictor=self.predictor,
            target_fn=self.target_fn,
        )
        for g in groups:
            writer.write(g)
            self.predictor.observe(g.prompt_id, [r.length for r in g.responses])
        writer.flush()
        self.stats["worker/batches"] += 1
        self.stats["worker/groups_written"] += len(groups)
        abandoned = int(self.engine.last_stats.get("engine/abandoned_samples", 0))
        self.stats["worker/abandoned_samples"] += abandoned
        if len(groups) < len(batch):
            self.log(
                f"batch {b}: stopped; wrote {len(groups)} of {len(batch)} groups, "
                f"dropped {abandoned} samples in flight"
            )
        else:
            self.log(
                f"batch {b}: wrote {len(groups)} groups "
                f"({self.engine.last_stats['engine/tokens_per_s']:.0f} tok/s)"
            )


# ---- entry points ---------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """`python -m espo_jax.rollout.worker`: the flags of `espo_jax.rollout.worker_flags`."""
    from absl import app

    from espo_jax import configs
    from espo_jax.rollout import worker_flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    config, workdir = worker_flags.CONFIG.value, worker_flags.WORKDIR.value
    jax.config.update("jax_compilation_cache_dir",  # the main job's cache (espo_jax.main)
                      os.path.expanduser("~/.cache/espo_jax/jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    configs.validate(config, n_devices=jax.device_count())
    os.makedirs(workdir, exist_ok=True)
    return main_from_config(config, workdir, **worker_flags.worker_args())


def main_from_config(config, workdir: str, index: int = 0, num_workers: int = 1, *,
                     max_batches: int | None = None, until_version: int | None = None,
                     stats: str | None = None) -> int:
    """A worker built from an experiment config (`python -m espo_jax.main --mode=rollout`, the
    async loop's worker processes, `python -m espo_jax.rollout.worker`).

    Weights from WORKDIR/weights (where the learner publishes), groups to the configured buffer
    (default WORKDIR/buffer), prompts cycling over the training set, the task's verifier.
    Worker `index` of `num_workers` takes every `num_workers`-th prompt starting at `index`
    and its own RNG stream, so workers never duplicate each other's groups. It stops after
    `max_batches`, after a batch sampled at policy version >= `until_version`, or on SIGTERM;
    `stats`: a JSON file for the run's counters.
    """
    setup = run_setup.build(config, workdir)
    r = config.rollout
    sampling = SamplingConfig(
        r.temperature, r.top_k, r.top_p, r.max_new_tokens, (setup.tokenizer.eos_id,)
    )
    wc = WorkerConfig(
        publish_dir=os.path.join(workdir, "weights"),
        buffer_dir=config.buffer.dir or os.path.join(workdir, "buffer"),
        writer_id=f"rollout-{index}",
        n_samples=config.zve.n_samples,
        prompts_per_batch=r.prompts_per_step,
        sampling=sampling,
        precision=r.precision,
        max_slots=r.num_slots,
        steps_per_sync=r.steps_per_sync,
        prefill_rows=r.prefill_rows,
        max_cache_len=r.max_prompt_len + r.max_new_tokens,
        reward_workers=r.reward_workers,
        reward_timeout_s=r.reward_timeout_s,
        seed=config.seed * 1000 + index,
        max_batches=max_batches,
    )
    reward, target_fn = tasks.reward_fn(config)
    decode = tasks.decoder(config, setup.tokenizer)
    mine = run_setup.worker_share(setup.train_prompts, index, num_workers)
    prompts = itertools.chain.from_iterable(itertools.repeat(mine))

    def until(stream):  # batch b's prompts are taken before its reload: version is b - 1's
        for n, p in enumerate(stream):
            if n and n % wc.prompts_per_batch == 0 and worker.version >= until_version:
                return
            yield p

    worker = RolloutWorker(wc, until(prompts) if until_version is not None else prompts, reward,
                           detokenize=decode, target_fn=target_fn,
                           log=functools.partial(print, flush=True))
    worker.install_signal_handlers()
    counters = worker.run()
    if stats:
        import json

        with open(stats, "w") as f:
            json.dump(counters, f)
    return 0


if __name__ == "__main__":
    from absl import app, flags

    from espo_jax.rollout import worker_flags

    flags.adopt_module_key_flags(worker_flags)  # --help lists them
    app.run(main)
