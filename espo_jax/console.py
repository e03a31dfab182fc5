"""The main job's console: progress bars and results on the terminal, everything in a log file.

At the default verbosity the console shows espo_jax's own messages (bare text, no absl
prefix), warnings and errors from anything, one progress bar per phase (warm start, RL) with its
live metrics, and the summary table at the end; INFO records of the libraries (orbax
checkpointing internals, TFDS, JAX backend probing) and espo_jax's per-step lines go only to
`WORKDIR/log.txt`, which keeps every record. `--verbosity=1` (absl's flag) puts everything on
the console again.

    logging.info("RL step %d ...", step, extra=console.FILE_ONLY)   # log file only
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping

FILE_ONLY = {"console": False}  # `extra=` of a record that goes to the log file only
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


# Library warnings that say nothing to act on: TFDS names every custom builder config.
_MUTED = ("Using custom data configuration",)


class _ConsoleFilter(logging.Filter):
    """Warnings and errors from anything (but `_MUTED`); INFO only from espo_jax, unless marked
    FILE_ONLY."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return not (record.levelno < logging.ERROR
                        and str(record.msg).startswith(_MUTED))
        if getattr(record, "console", True) is False:
            return False
        return record.pathname.startswith(_PACKAGE_DIR)


class _ConsoleFormatter(logging.Formatter):
    """INFO records (espo_jax's own messages) as their bare text between the progress bars;
    warnings and errors keep absl's prefix (level, time, file:line) that says where from."""

    def __init__(self, absl_formatter: logging.Formatter):
        super().__init__()
        self.absl = absl_formatter

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.WARNING:
            return self.absl.format(record)
        return record.getMessage()


_QUIET = [False]


def quiet(verbosity: int = 0) -> None:
    """Below `verbosity` 1, filters the console (absl's handler) as the module doc says."""
    from absl import logging as absl_logging

    console = absl_logging.get_absl_handler()
    for f in [f for f in console.filters if isinstance(f, _ConsoleFilter)]:
        console.removeFilter(f)
    _QUIET[0] = verbosity < 1
    console.setFormatter(absl_logging.PythonFormatter())
    if verbosity < 1:
        console.addFilter(_ConsoleFilter())
        console.setFormatter(_ConsoleFormatter(absl_logging.PythonFormatter()))
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # TF only writes event files here


def is_quiet() -> bool:
    """Whether `quiet` filtered the console: libraries' progress bars stay off then (TFDS's
    while a dataset is prepared, `espo_jax.data.tfds_offline.prepare`)."""
    return _QUIET[0]


def log_to_file(workdir: str) -> str:
    """Sends every record (all levels from INFO, every library) to `workdir/log.txt`; returns
    its path. Called once the config is known to be valid (a bad value writes nothing)."""
    from absl import logging as absl_logging

    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "log.txt")
    root = logging.getLogger()
    if not any(getattr(h, "_espo_log", None) == path for h in root.handlers):
        handler = logging.FileHandler(path)
        handler.setFormatter(absl_logging.PythonFormatter())
        handler._espo_log = path  # one file handler per path, whatever the number of calls
        root.addHandler(handler)
    return path


def worker_logging(log_path: str) -> None:
    """The logging of a rollout worker process the learner spawned: every record to its log
    file, warnings and errors (but `_MUTED`) to stderr, which it shares with the learner."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    to_file = logging.FileHandler(log_path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_console = logging.StreamHandler(sys.stderr)
    to_console.setLevel(logging.WARNING)
    to_console.addFilter(_ConsoleFilter())
    root.addHandler(to_file)
    root.addHandler(to_console)
    root.setLevel(logging.INFO)


class Progress:
    """One phase's progress on stderr with its live metrics: a bar redrawn in place on a
    terminal, else a line at every tenth of the way (and at the end)."""

    def __init__(self, phase: str, total: int, *, stream=None):
        self.phase, self.total = phase, max(int(total), 1)
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.time()
        self._tenth = -1

    def update(self, done: int, metrics: Mapping[str, float] | None = None,
               frac: float | None = None) -> None:
        """`done` of `total` steps; `frac` (when given) is the share of the phase behind, for
        phases that end on another budget than their step count (the bar and eta follow it)."""
        frac = min(done / self.total if frac is None else frac, 1.0)
        width = 24
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        elapsed = time.time() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        shown = "  ".join(f"{k} {v:.3g}" for k, v in (metrics or {}).items())
        line = (f"{self.phase:<10} [{bar}] {done}/{self.total}  {elapsed:.0f} s"
                f"{f' (eta {eta:.0f} s)' if frac < 1.0 else ''}  {shown}")
        end = frac >= 1.0  # done >= total when no share is given
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if end else ""))
            self.stream.flush()
        elif int(frac * 10) > self._tenth or end:
            self._tenth = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()


def summary_table(summary: Mapping) -> str:
    """The run's summary.json figures as a short two-column table (no-signal tokens:
    `espo_jax.zve.accounting`, which also reads a summary written under former names)."""
    from espo_jax.zve import accounting

    summary = accounting.current_names(summary)
    rows = [("held-out accuracy", f"{summary['warmstart_accuracy']:.3f} -> "
                                  f"{summary['final_accuracy']:.3f}"),
            *([("test accuracy (end)", f"{summary['test_accuracy']:.3f}")]
              if "test_accuracy" in summary else []),
            ("RL steps", str(summary["steps"])),
            ("warm-start steps", str(summary.get("warmstart_steps", 0))),
            ("wall time", f"{summary['wall_seconds']:.0f} s (RL {summary['rl_seconds']:.0f} s, "
                          f"warm start {summary.get('warmstart_seconds', 0.0):.0f} s)"),
            ("generated tokens", f"{summary['generated_tokens']:,}"),
            *([("no-signal token frac", f"{summary['no_signal_token_frac']:.3f}")]
              if "no_signal_token_frac" in summary else []),
            ("no-signal token frac with offline",
             f"{summary['no_signal_token_frac_with_offline']:.3f}"),
            ("mean |log-prob mismatch|", f"{summary['mean_abs_logp_mismatch']:.2e}"),
            ("skipped updates", str(summary.get("skipped_updates", 0)))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
