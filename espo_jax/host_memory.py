"""Transparent huge pages for XLA:CPU's host buffers (glibc's `glibc.malloc.hugetlb` tunable).

XLA:CPU allocates each execution's temporary buffers afresh: bench peers' train step takes one
224 MiB block a call. glibc serves a block over 32 MiB with `mmap` and gives it back with
`munmap`, so every call faults the block's pages in again, 4 KiB at a time: ~65,000 minor
faults and ~140 ms of kernel time a call, against a ~330 ms step (2-core AMD EPYC). With the
tunable `glibc.malloc.hugetlb=1` glibc advises transparent huge pages (2 MiB) for the blocks it
maps and for its heap: ~1,000-6,000 faults and ~55 ms a call, and the step 10-20% faster
(experiments/arith_common.py, "Recipe log"). The samples and losses are bit for bit the same.

glibc reads its tunables at process start only, so `reexec_with_huge_pages()` starts the
process again, in place (the same pid, arguments and open files), with the tunable added to
`GLIBC_TUNABLES`. The entry points (`python -m espo_jax.main`, `python -m
espo_jax.rollout.worker`, `python -m espo_jax.bench`) call it before anything else; library
code never does. `without_huge_pages` gives a child glibc's defaults (bench peers' TRL and
torch side). It does
nothing when `ESPO_JAX_HUGE_PAGES=0`, when the tunable is already set (by a user or the first
start), without glibc >= 2.35 (the tunable's first release), or unless the kernel's
transparent huge pages are in `madvise` mode (`always` already gives them, `never` cannot).
Child processes inherit the setting from the environment.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

OFF_SWITCH = "ESPO_JAX_HUGE_PAGES"  # "0": leave glibc's allocator as it is
TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE_PATH) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"); None if unknown
    (not Linux, or no THP support)."""
    try:
        with open(path) as f:
            match = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc; None otherwise (musl, macOS)."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return None
    match = re.match(r"glibc (\d+)\.(\d+)", name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def huge_pages_env(environ: Mapping[str, str], thp: str | None,
                   glibc: tuple[int, int] | None) -> dict[str, str] | None:
    """The environment to start again with (`environ` with the tunable appended to
    GLIBC_TUNABLES), or None when there is nothing to do (see the module docstring)."""
    if environ.get(OFF_SWITCH, "1") == "0" or huge_pages_set(environ):
        return None
    if glibc is None or glibc < (2, 35) or thp != "madvise":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, f"{TUNABLE}=1"]))}


def _tunables(environ: Mapping[str, str]) -> list[str]:
    """GLIBC_TUNABLES' entries (`name=value`), in order."""
    return [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]


def _ours(entry: str) -> bool:
    return entry.partition("=")[0] == TUNABLE


def huge_pages_set(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process runs with the tunable set (to anything: a user's 0 counts)."""
    return any(map(_ours, _tunables(environ)))


def huge_pages_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether glibc advises huge pages in this process: the tunable set, and not to 0 (what
    the benchmarks report; a user's `hugetlb=0` is set but off)."""
    values = [t.partition("=")[2] for t in _tunables(environ) if _ours(t)]
    return bool(values) and values[-1] != "0"


def without_huge_pages(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a child that should run with glibc's allocator defaults: the tunable taken
    out of GLIBC_TUNABLES (the other tunables kept; the variable dropped if nothing is left),
    and the off switch set, so that an espo_jax entry point started there does not restart."""
    kept = [t for t in _tunables(environ) if not _ours(t)]
    env = {k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"} | {OFF_SWITCH: "0"}
    return env | ({"GLIBC_TUNABLES": ":".join(kept)} if kept else {})


def reexec_with_huge_pages() -> None:
    """Replaces this process with a fresh start of the same command line under
    `huge_pages_env`; returns at once when that is None. Call it first in an entry point."""
    env = huge_pages_env(os.environ, thp_mode(), glibc_version())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
