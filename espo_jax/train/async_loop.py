"""The distributed layout on one machine: a learner process and N rollout worker processes.

They meet only at two directories: the rollout buffer (workers write `RolloutGroup`s, the
learner reads them with its exactly-once cursor) and the published-weights directory (the
learner publishes version v after its v-th update; workers load the newest version between
batches). Groups sampled by a policy more than `train.max_staleness` versions old are dropped
by the reader and counted. MS-ZVE on this path: stage 4 (online filter) and stage 2 (tie-break)
run on the learner as groups arrive, stage 3 in its advantages; stages 0/1/5 need the
scheduler's history on the rollout side and are only used by the single-process loop.
Workers are real processes (spawn); they stop on SIGTERM after writing their finished groups.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import time

import ml_collections
import numpy as np

from espo_jax import distributed
from espo_jax.buffer import BufferReader, weights
from espo_jax.models import hf_io
from espo_jax.train.loop import Run
from espo_jax.train.metrics import rollout_metrics
from espo_jax.zve import OnlineFilter, ScoredGroup, groups_and_rewards, score_groups, step_metrics


def _worker_main(config_json: str, workdir: str, index: int) -> None:
    """Entry point of rollout worker process `index` (spawned; builds its own set-up)."""
    from espo_jax.rollout import worker

    config = ml_collections.ConfigDict(json.loads(config_json))
    worker.main_from_config(config, workdir, index=index, num_workers=config.train.num_workers)


def start_workers(config, workdir: str) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(config.train.num_workers):
        p = ctx.Process(target=_worker_main, args=(config.to_json(), workdir, i),
                        name=f"rollout-{i}")
        p.start()
        procs.append(p)
    return procs


def stop_workers(procs: list[mp.Process], timeout_s: float = 120.0) -> list[int]:
    """SIGTERM, wait for a clean exit, SIGKILL what hangs; returns the exit codes."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            logging.warning("worker %s did not stop in %.0f s: killing it", p.name, timeout_s)
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


class AsyncRun(Run):
    """Learner side of the async layout; `run()` returns the summary dict."""

    def _groups(self, reader: BufferReader, n: int, version: int) -> list[ScoredGroup]:
        """`n` groups from the buffer (blocking), each with its MS-ZVE (stage 2) rewards."""
        read = []
        while distributed.is_primary() and len(read) < n:  # process 0 reads, all train on it
            read += reader.read(n - len(read), timeout_s=600.0, policy_version=version)
            if self._dead_workers():
                raise RuntimeError(f"rollout workers died: {self._dead_workers()}")
        groups = distributed.broadcast_groups(read if distributed.is_primary() else None)
        return score_groups(groups, self.config.zve.tie_break, self.config.rollout.max_new_tokens)

    def _publish(self, publish_dir: str, version: int, params) -> None:
        """All processes gather the parameters (a collective); process 0 writes them, with the
        Hugging Face export that vLLM workers load."""
        host = distributed.gather_to_host(params)
        if distributed.is_primary():
            config = self.setup.model_config
            hf = hf_io.exporter(config, host) if self.config.rollout.engine == "vllm" else None
            weights.publish(publish_dir, version, config, host, hf_export=hf)

    def _dead_workers(self) -> list[str]:
        return [f"{p.name} (exit {p.exitcode})" for p in self.procs if not p.is_alive()]

    def run(self) -> dict:
        c = self.config
        state, meta = self._start()
        learner = self.make_learner(state, meta)
        publish_dir = os.path.join(self.workdir, "weights")
        step = meta["rl_step"]
        found = weights.latest(publish_dir)
        if found is None or found[0] < step:
            self._publish(publish_dir, step, state.params)
        reader = BufferReader(self.buffer_dir, cursor=meta["cursor"],
                              max_staleness=c.train.max_staleness,
                              retention="keep" if c.buffer.keep_consumed else "delete")
        online = OnlineFilter.for_zve(c.zve)
        self.procs = start_workers(c, self.workdir) if distributed.is_primary() else []
        try:
            while step < c.train.steps:
                t_step = time.time()
                result = online.collect(c.rollout.prompts_per_step,
                                        lambda n, v=step: self._groups(reader, n, v))
                zmetrics = step_metrics(result.generated, result.batch,
                                        zvp_enabled=c.zve.zvp.enabled)
                zmetrics.update(online.metrics(result))
                groups, rewards = groups_and_rewards(result.batch)
                lags = [step - g.policy_version for g in groups]
                t_update = time.time()
                state, lmetrics = learner.update(state, groups, rewards)
                t_publish = time.time()
                step += 1
                self._publish(publish_dir, step, state.params)
                t_done = time.time()
                self.record_step(meta, step, zmetrics, lmetrics)
                metrics = {**zmetrics, **lmetrics, **rollout_metrics(groups, rewards),
                           "async/staleness_max": float(max(lags, default=0)),
                           "async/staleness_mean": float(np.mean(lags)) if lags else 0.0,
                           "async/stale_dropped": float(reader.stats["stale_dropped"]),
                           # waiting for the workers' groups / the update / publishing weights
                           "time/wait_s": t_update - t_step, "time/update_s": t_publish - t_update,
                           "time/publish_s": t_done - t_publish, "time/step_s": t_done - t_step}
                self.logger.write(step, metrics, phase="rl")
                logging.info("async RL step %d/%d: rollout acc %.3f, staleness <= %d, %.1f s",
                             step, c.train.steps, metrics["rollout/accuracy"],
                             int(metrics["async/staleness_max"]), metrics["time/step_s"])
                if step % c.checkpoint.every == 0 or step == c.train.steps:
                    meta.update(cursor=reader.cursor)
                    self.ckpt.save(step, state, meta)
                    self.ckpt.wait()
                    if distributed.is_primary():
                        reader.commit(meta["cursor"])
        finally:
            codes = stop_workers(self.procs)
            reader.close()
        self.extra_summary = {"worker_exit_codes": codes,
                              "stale_dropped": int(reader.stats["stale_dropped"])}
        return self.finish(state, meta)


def run_async(config, workdir: str) -> dict:
    return AsyncRun(config, workdir).run()
