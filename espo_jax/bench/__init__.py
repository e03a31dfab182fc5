"""Benchmarks: `python -m espo_jax.bench NAME [--quick] [--out FILE.json]`.

Each benchmark is a module `espo_jax.bench.<name>` with `run(quick: bool) -> dict`. It measures
things side by side in one process (this against that, same inputs, medians of repeats), prints
a table, and returns its figures; the runner (`espo_jax.bench.__main__`, absl flags) writes them
to `--out` as JSON. A benchmark's own flags (zve's `--init_from`, `--budget`, `--prompts`) are
defined in the runner too and reach its `run` as keyword arguments.
"""

import os
import statistics
import time
from collections.abc import Callable, Sequence

NAMES = ("model", "buffer", "engine", "zve", "attention", "peers", "packing", "profile",
         "device_check", "linear_decode", "real", "mla_decode", "aot", "scan")


# the vector and matrix units a CPU figure depends on, named with it
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_model() -> tuple[str | None, list[str]]:
    """The first CPU's model name in /proc/cpuinfo and which of MATMUL_FLAGS it has."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return fields.get("model name"), [x for x in MATMUL_FLAGS if x in flags]


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` over `repeats` calls after `warmup` untimed calls.

    `fn` must block until its work is done (e.g. call `jax.block_until_ready`).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (pasteable into the README)."""

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_times(path: str = "/proc/stat") -> dict[str, float] | None:
    """The machine's CPU seconds so far, all CPUs summed: busy, idle and steal (time the
    hypervisor gave this VM's CPUs to others while they had work). None where the file is
    missing (not Linux). Two readings' difference says how much of a benchmark's wall time
    the machine itself lost: a run with steal is noisier than one without."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]] + [0] * 8
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = ticks[:8]
    return {"busy_s": (user + nice + system + irq + softirq) / hz,
            "idle_s": (idle + iowait) / hz, "steal_s": steal / hz}
