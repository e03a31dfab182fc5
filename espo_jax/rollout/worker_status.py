"""A rollout worker's status, stop and flow control: what it shows and when it waits.

Stopping: SIGTERM / SIGINT (or `request_stop()`) make the sampler return at its next sync with
only the groups already complete (what the loop does with them: `espo_jax.rollout.worker_loop`).
A worker stops by itself when the learner's progress file says the run is done, or
(`exit_with_parent`) when the process that started it is gone.

Flow control (`espo_jax.buffer.flow`): before each batch the worker waits while `max_ahead` of
its shards are unread by the learner.

A heartbeat thread rewrites the worker's status file (`flow.status_path`) every few seconds:
state, weights version, counters, the scheduler's totals; the learner reads it for its health
metrics and to see which workers are live.

With a scheduler the worker keeps its state (scheduler, batch index, length predictor) in
`status_dir`, committed together with each batch's shard: a pending state is written before the
flush and made current after it, and a restarted worker takes the pending one only if its shard
reached the buffer (`flow.shard_durable`), so no prompt's group is lost or written twice.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

from espo_jax.buffer import BufferWriter, flow
from espo_jax.rollout import scheduling
from espo_jax.zve.status import ACTIVE, PRUNED, RETIRED


class WorkerStatus:
    """The status, stop and flow-control half of `worker_loop.RolloutWorker` (its base class).

    Reads the worker's `config` (a `worker_loop.WorkerConfig`), `log`, `sampler`, `scheduler`,
    `version`, `stats`, `predictor`, `batch_index`, `offline_done`, `offline_metrics` and
    `_pool`, and its control state `_stop` (an Event), `_lock`, `_state`, `_stream`, `_parent`
    (the parent's pid), all set by `RolloutWorker.__init__`."""

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

