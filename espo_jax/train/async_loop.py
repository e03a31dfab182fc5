"""The worker layout: a learner and rollout worker processes meeting at shared directories.

    WORKDIR/weights/    the learner publishes version v after its v-th update, and its progress
                        (`progress.json`: RL step, the reader's cursor) after every read
    WORKDIR/buffer/     workers write scored `RolloutGroup`s; the learner reads them exactly once
    WORKDIR/workers/    each worker's heartbeat status and prompt-scheduler state

MS-ZVE is split as the data flows: stages 0 (offline pruning), 1 (adaptive samples) and 5
(retire / re-probe) run in each worker, on a `PromptScheduler` over its share of the prompts
(the single-process loop's code, `espo_jax.rollout.worker`); stages 4 (online filter) and 2
(tie-break) run here as groups arrive, stage 3 in the learner's advantages. Flow control
(`espo_jax.buffer.flow`): a worker samples a batch only while fewer than `train.max_staleness +
rollout.max_inflight_batches - 1` of its batches are unread, so groups are seldom too old; those
that are (`policy_version` more than `train.max_staleness` behind) are dropped by the reader and
their tokens counted (`async/stale_dropped`, `async/stale_token_frac`); their responses count
as generated in the step's `lengths/generated_mean` and `_p90`, against `lengths/trained_...`
(`zve.metrics.length_metrics`), so a tilt toward short responses from dropping shows.

Workers: with `train.num_workers` > 0 the learner spawns them (they stop when it does or dies)
and restarts one that dies, up to `train.worker_restarts` times; with 0 they are started
elsewhere (`--config.mode=rollout`, launch scripts) and only their status files are seen. The
learner refuses unscored groups (`zve.UnscoredGroupError`), stops after a checkpoint when a
step's failed-reward fraction exceeds `rollout.max_failed_reward_frac`, and stops when no worker
has been live for `train.worker_timeout_s`. A killed learner resumes from its checkpoint with
the same command: it re-reads from the checkpoint's cursor what it had read after it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from espo_jax import console, distributed, run_setup
from espo_jax.buffer import BufferReader, flow, weights
from espo_jax.models import hf_io, scan
from espo_jax.train.metrics import rollout_metrics
from espo_jax.train.run import Run, raise_failed_rewards
from espo_jax.zve import (
    OnlineFilter,
    ScoredGroup,
    failed_reward_fraction,
    groups_and_rewards,
    length_metrics,
    require_scored,
    score_groups,
    step_metrics,
)

_READ_SLICE_S = 2.0  # the learner checks on its workers this often while it waits
_WAIT_LOG_S = 30.0


def _worker_main(config_json: str, workdir: str, index: int) -> None:
    """Entry point of rollout worker process `index` (spawned; builds its own set-up)."""
    from espo_jax.rollout import worker

    config = ml_collections.ConfigDict(json.loads(config_json))
    log_path = os.path.join(workdir, "workers", f"rollout-{index}.log")
    console.worker_logging(log_path)
    worker.main_from_config(config, workdir, index=index, num_workers=config.train.num_workers,
                            exit_with_parent=True, log_path=log_path)


def start_worker(config, workdir: str, index: int) -> mp.Process:
    p = mp.get_context("spawn").Process(target=_worker_main,
                                        args=(config.to_json(), workdir, index),
                                        name=f"rollout-{index}")
    p.start()
    return p


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


def wait_for_orphans(status_dir: str, timeout_s: float = 60.0) -> None:
    """Workers a killed learner spawned stop within a heartbeat of noticing (exit_with_parent);
    a restarted learner waits for them before it starts workers with the same ids."""
    import socket

    host = socket.gethostname()
    pids = [int(s["pid"]) for s in flow.read_statuses(status_dir)
            if s.get("host") == host and s.get("state") != "done" and s.get("pid")]
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _alive(pid):
            logging.warning("rollout worker pid %d of an earlier learner still runs: killing it",
                            pid)
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True



def rollout_weights(model_config, params) -> tuple:
    """(config, params) as rollout engines load them: floating weights in the model's compute
    dtype (bf16 at scale: half the bytes of the learner's float32 masters to write and read),
    the sigmoid router's correction bias kept float32 as checkpoints hold it; per layer
    (`models.scan.unstack`), the layout engines and Hugging Face exports read."""
    dtype = np.dtype(jnp.dtype(model_config.dtype))

    def cast(path, x):
        keep = jax.tree_util.keystr(path).endswith("['e_score_correction_bias']")
        return x if keep or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

    return (model_config.replace(param_dtype=model_config.dtype, scan_layers=False),
            jax.tree_util.tree_map_with_path(cast, scan.unstack(params)))

class AsyncRun(Run):
    """Learner side of the worker layout; `run()` returns the summary dict."""

    def __init__(self, config, workdir: str):
        super().__init__(config, workdir)
        self.publish_dir = os.path.join(workdir, "weights")
        self.status_dir = os.path.join(workdir, "workers")
        self.procs: dict[int, mp.Process] = {}
        self.restarts: dict[int, int] = {}
        self.exit_codes: dict[int, list[int]] = {}

    # -- workers ----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        if not distributed.is_primary() or self.config.train.num_workers == 0:
            return
        wait_for_orphans(self.status_dir)
        for i in range(self.config.train.num_workers):
            self.procs[i] = start_worker(self.config, self.workdir, i)

    def _tend_workers(self) -> None:
        """Restarts spawned workers that died (up to `train.worker_restarts` each)."""
        for i, p in list(self.procs.items()):
            if p.is_alive():
                continue
            self.exit_codes.setdefault(i, []).append(p.exitcode)
            if self.restarts.get(i, 0) >= self.config.train.worker_restarts:
                logging.warning("rollout worker %d died (exit %s) and was restarted %d times: "
                                "going on without it", i, p.exitcode, self.restarts.get(i, 0))
                del self.procs[i]
                continue
            self.restarts[i] = self.restarts.get(i, 0) + 1
            logging.warning("rollout worker %d died (exit %s): restarting it (%d of %d)", i,
                            p.exitcode, self.restarts[i], self.config.train.worker_restarts)
            self.procs[i] = start_worker(self.config, self.workdir, i)

    def _live(self) -> list[dict]:
        return flow.live(flow.read_statuses(self.status_dir), self.config.train.worker_timeout_s)

    # -- reading ----------------------------------------------------------------------------
    def _groups(self, reader: BufferReader, n: int, version: int) -> list[ScoredGroup]:
        """`n` groups from the buffer (blocking), each with its MS-ZVE (stage 2) rewards."""
        read: list = []
        started = last_log = time.monotonic()
        last_live = time.monotonic()
        while distributed.is_primary() and len(read) < n:  # process 0 reads, all train on it
            self._tend_workers()  # also while other workers deliver
            got = reader.read(n - len(read), timeout_s=_READ_SLICE_S, policy_version=version)
            if got:
                read += got
                flow.write_progress(self.publish_dir, version, reader.cursor)
                continue
            live = self._live()
            now = time.monotonic()
            if live or any(p.is_alive() for p in self.procs.values()):
                last_live = now
            elif now - last_live > self.config.train.worker_timeout_s:
                raise RuntimeError(
                    f"no live rollout workers for {now - last_live:.0f} s (no status file in "
                    f"{self.status_dir} updated within train.worker_timeout_s="
                    f"{self.config.train.worker_timeout_s}): start them with "
                    "--config.mode=rollout, or set train.num_workers > 0")
            if now - last_log >= _WAIT_LOG_S:
                logging.info("waiting for %d groups from %d live workers (%.0f s so far)",
                             n - len(read), len(live), now - started)
                last_log = now
        groups = distributed.broadcast_groups(read if distributed.is_primary() else None)
        require_scored(groups)
        self._read_this_step += groups
        return score_groups(groups, self.config.zve.tie_break, self.config.rollout.max_new_tokens)

    def _publish(self, version: int, params) -> None:
        """All processes gather the parameters (a collective); process 0 writes them, with the
        Hugging Face export that vLLM workers load. A version holds the weights in the model's
        compute dtype (`rollout_weights`), not the learner's float32 masters."""
        host = distributed.gather_to_host(params)
        if distributed.is_primary() and weights.version_dir(self.publish_dir, version).exists():
            # A learner killed after publishing `version` but before its checkpoint: the resumed
            # run recomputed the same update (same groups from the checkpoint's cursor); workers
            # may already sample with the published one, so it stays.
            logging.info("weights version %d is already published: keeping it", version)
        elif distributed.is_primary():
            config, host = rollout_weights(self.setup.model_config, host)
            hf = None
            if self.config.rollout.engine == "vllm":  # in the family the run read, if one
                source = self.config.model.hf_path and run_setup.model_dir(self.config)
                hf = hf_io.exporter(config, host, model_type=hf_io.source_model_type(source))
            weights.publish(self.publish_dir, version, config, host, hf_export=hf)

    # -- metrics ----------------------------------------------------------------------------
    def _health(self, reader: BufferReader, statuses: list[dict]) -> dict[str, float]:
        """Buffer, reward and worker figures for one step (cumulative counts)."""
        s = reader.stats
        written = sum(st.get("worker/tokens_written", 0) for st in statuses)
        m = {f"buffer/{k}": float(s[k]) for k in (
            "groups_read", "stale_dropped", "stale_dropped_tokens", "corrupt_records",
            "missing_shards")}
        m["async/stale_token_frac"] = s["stale_dropped_tokens"] / max(written, 1)
        m["async/tokens_written"] = float(written)
        m["workers/live"] = float(len(flow.live(statuses, self.config.train.worker_timeout_s)))
        m["workers/restarts"] = float(sum(self.restarts.values()))
        for key in ("failed", "timeouts"):
            m[f"reward/{key}"] = float(sum(st.get(f"reward/{key}", 0) for st in statuses))
        for st in statuses:  # the workers' MS-ZVE stages 0, 1, 5: summed over workers
            for k, v in (st.get("zve") or {}).items():
                m[k] = m.get(k, 0.0) + float(v)
        for st in statuses:
            wid = st["writer_id"]
            m[f"worker/{wid}/groups_written"] = float(st.get("worker/groups_written", 0))
            m[f"worker/{wid}/policy_version"] = float(st.get("policy_version") or -1)
            m[f"worker/{wid}/max_ahead"] = float(st.get("worker/max_ahead", 0))
        return m

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> dict:
        c = self.config
        state, meta = self._start()
        learner = self.make_learner(state, meta)
        step = meta["rl_step"]
        found = weights.latest(self.publish_dir)
        if found is None or found[0] < step:
            self._publish(step, state.params)
        stale_lengths: list[int] = []  # of this step's groups dropped as stale
        reader = BufferReader(self.buffer_dir, cursor=meta["cursor"],
                              max_staleness=c.train.max_staleness,
                              retention="keep" if c.buffer.keep_consumed else "delete",
                              on_stale=lambda g: stale_lengths.extend(g.response_lengths.tolist()))
        if distributed.is_primary():
            os.makedirs(self.status_dir, exist_ok=True)
            flow.write_progress(self.publish_dir, step, reader.cursor)
        online = OnlineFilter.for_zve(c.zve)
        self._start_workers()
        statuses: list[dict] = []
        progress = console.Progress("RL", c.train.steps)
        try:
            while not self.finished(step, meta):
                t_step = time.time()
                self._read_this_step = []
                stale_lengths.clear()
                result = online.collect(c.rollout.prompts_per_step,
                                        lambda n, v=step: self._groups(reader, n, v))
                self.log_consumed(step + 1, self._read_this_step, reader.cursor)
                zmetrics = step_metrics(result.generated, result.batch,
                                        zvp_enabled=c.zve.zvp.enabled,
                                        zvp_wrong=c.zve.zvp.wrong_groups)
                zmetrics.update(online.metrics(result))
                zmetrics.update(length_metrics(result.generated, result.batch, stale_lengths))
                groups, rewards = groups_and_rewards(result.batch)
                lags = [step - g.policy_version for g in groups]
                t_update = time.time()
                state, lmetrics = learner.update(state, groups, rewards, policy_version=step)
                t_publish = time.time()
                step += 1
                self._publish(step, state.params)
                t_done = time.time()
                if distributed.is_primary():
                    flow.write_progress(self.publish_dir, step, reader.cursor)
                    statuses = flow.read_statuses(self.status_dir)
                self.record_step(meta, step, zmetrics, lmetrics)
                done = self.finished(step, meta)
                metrics = {**zmetrics, **lmetrics, **rollout_metrics(groups, rewards),
                           **self._health(reader, statuses),
                           "zve/samples_per_prompt": float(np.mean(
                               [g.group.num_responses for g in result.generated])),
                           "async/staleness_max": float(max(lags, default=0)),
                           "async/staleness_mean": float(np.mean(lags)) if lags else 0.0,
                           "async/stale_dropped": float(reader.stats["stale_dropped"]),
                           # waiting for the workers' groups / the update / publishing weights
                           "time/wait_s": t_update - t_step, "time/update_s": t_publish - t_update,
                           "time/publish_s": t_done - t_publish, "time/step_s": t_done - t_step}
                failed = failed_reward_fraction([g.group for g in result.generated])
                metrics["reward/failed_frac"] = failed
                if c.eval.every and step % c.eval.every == 0 and not done:
                    metrics.update(self.evaluate(state.params))
                self.logger.write(step, metrics, phase="rl")
                self.samples.write(step, self._read_this_step, result.batch)
                logging.info(
                    "async RL step %d/%d: rollout acc %.3f, staleness <= %d, waited %.1f s of "
                    "%.1f s; %d live workers, stale dropped %d groups (%.2f%% of tokens), "
                    "corrupt %d, missing %d, reward failures %d", step, c.train.steps,
                    metrics["rollout/accuracy"], int(metrics["async/staleness_max"]),
                    metrics["time/wait_s"], metrics["time/step_s"], metrics["workers/live"],
                    reader.stats["stale_dropped"], 100 * metrics["async/stale_token_frac"],
                    reader.stats["corrupt_records"], reader.stats["missing_shards"],
                    metrics["reward/failed"], extra=console.FILE_ONLY)
                progress.update(step, {"rollout acc": metrics["rollout/accuracy"],
                                       "staleness": metrics["async/staleness_max"],
                                       "workers": metrics["workers/live"],
                                       "s/step": metrics["time/step_s"]},
                                frac=self.share_done(step, meta))
                too_many_failed = failed > c.rollout.max_failed_reward_frac
                if step % c.checkpoint.every == 0 or done or too_many_failed:
                    meta.update(cursor=reader.cursor)
                    self.ckpt.save(step, state, meta)
                    self.ckpt.wait()
                    if distributed.is_primary():
                        reader.commit(meta["cursor"])
                if too_many_failed:
                    raise_failed_rewards(step, failed, c.rollout.max_failed_reward_frac)
        finally:
            if distributed.is_primary():
                flow.write_progress(self.publish_dir, step, reader.cursor,
                                    done=self.finished(step, meta))
            codes = stop_workers(list(self.procs.values()))
            reader.close()
        statuses = flow.read_statuses(self.status_dir) if distributed.is_primary() else []
        written = sum(st.get("worker/tokens_written", 0) for st in statuses)
        offline = sum((st.get("zve") or {}).get("zve/offline_tokens", 0) for st in statuses)
        meta["offline_tokens"] = int(offline)
        self.extra_summary = {
            "worker_exit_codes": codes, "worker_restarts": dict(self.restarts),
            "stale_dropped": int(reader.stats["stale_dropped"]),
            "stale_dropped_tokens": int(reader.stats["stale_dropped_tokens"]),
            "tokens_written_by_workers": int(written),
            "stale_token_fraction": reader.stats["stale_dropped_tokens"] / max(written, 1)}
        return self.finish(state, meta)


def run_async(config, workdir: str) -> dict:
    return AsyncRun(config, workdir).run()
