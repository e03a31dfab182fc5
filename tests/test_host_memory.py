"""Huge pages for XLA:CPU's host buffers: when the entry points restart under glibc's
`glibc.malloc.hugetlb` tunable, and that the restarted process faults large blocks in 2 MiB
pages (real subprocesses, the kernel's own fault counters)."""

import json
import os
import subprocess
import sys

import pytest

from espo_jax import host_memory

MADVISE, GLIBC = "madvise", (2, 36)

# A child that calls the entry points' hook, then takes a 256 MiB block from glibc's malloc (as
# XLA's buffers are; numpy would advise huge pages itself) and touches every byte; it reports
# its environment and the block's minor page faults.
CHILD = r"""
import ctypes, json, os, resource, sys
from espo_jax import host_memory
host_memory.reexec_with_huge_pages()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 256 * 2**20
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size)
ctypes.memset(block, 1, size)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES"), "pid": os.getpid(),
                  "argv": sys.argv[1:], "faults": faults,
                  "byte": ctypes.cast(block + size - 1, ctypes.POINTER(ctypes.c_ubyte))[0]}))
"""


def run_child(**env):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("GLIBC_TUNABLES", host_memory.OFF_SWITCH)} | env
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "an-arg"], env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1]) | {"spawned_pid": proc.pid}


def test_env_adds_the_tunable_when_the_kernel_advises():
    env = host_memory.huge_pages_env({"PATH": "/bin"}, MADVISE, GLIBC)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # A user's own tunables are kept, the new one appended.
    env = host_memory.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, MADVISE,
                                     GLIBC)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("environ,thp,glibc", [
    ({"ESPO_JAX_HUGE_PAGES": "0"}, MADVISE, GLIBC),  # turned off
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, MADVISE, GLIBC),  # the user's choice
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, MADVISE, GLIBC),  # already restarted
    ({}, "always", GLIBC),  # the kernel gives huge pages anyway
    ({}, "never", GLIBC),  # it gives none
    ({}, None, GLIBC),  # no THP (or not Linux)
    ({}, MADVISE, (2, 34)),  # glibc before the tunable
    ({}, MADVISE, None),  # not glibc
])
def test_env_leaves_the_process_alone(environ, thp, glibc):
    assert host_memory.huge_pages_env(environ, thp, glibc) is None


def test_child_env_without_the_tunable_keeps_the_rest():
    env = host_memory.without_huge_pages({"PATH": "/bin", "GLIBC_TUNABLES":
                                          "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2",
                   "ESPO_JAX_HUGE_PAGES": "0"}  # and no restart in an entry point there
    env = host_memory.without_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert env == {"ESPO_JAX_HUGE_PAGES": "0"}
    assert host_memory.huge_pages_env(env, MADVISE, GLIBC) is None


@pytest.mark.parametrize("tunables,on", [
    ("glibc.malloc.hugetlb=1", True), ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2", True),
    ("glibc.malloc.hugetlb=0", False),  # set by a user, but off
    ("glibc.malloc.arena_max=2", False), ("", False)])
def test_huge_pages_on_reads_the_tunable_s_value(tunables, on):
    assert host_memory.huge_pages_on({"GLIBC_TUNABLES": tunables}) is on


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert host_memory.thp_mode(str(path)) == MADVISE
    assert host_memory.thp_mode(str(tmp_path / "missing")) is None


def test_restart_sets_the_tunable_and_keeps_the_process():
    expected = host_memory.huge_pages_env({}, host_memory.thp_mode(),
                                          host_memory.glibc_version())
    child = run_child()
    # The same process (a supervisor's pid still reaches it) and command line after the
    # restart; the tunable exactly when this machine qualifies.
    assert child["pid"] == child["spawned_pid"]
    assert child["argv"] == ["an-arg"]
    assert child["tunables"] == (None if expected is None else expected["GLIBC_TUNABLES"])
    assert run_child(ESPO_JAX_HUGE_PAGES="0")["tunables"] is None


@pytest.mark.skipif(host_memory.huge_pages_env({}, host_memory.thp_mode(),
                                               host_memory.glibc_version()) is None,
                    reason="this machine's kernel or C library does not take the tunable")
def test_restarted_process_faults_large_blocks_in_huge_pages():
    plain, huge = run_child(ESPO_JAX_HUGE_PAGES="0"), run_child()
    assert plain["byte"] == huge["byte"] == 1
    # 256 MiB in 4 KiB pages is 65,536 faults; in 2 MiB pages 128 (a fraction of the block
    # may still come in small pages when the kernel has no free huge page at hand).
    assert plain["faults"] > 60_000
    assert huge["faults"] < plain["faults"] / 4
