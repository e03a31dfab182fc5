"""Multi-host JAX (multi-controller): start-up, process roles, and global batches.

One learner process runs per host (per GPU node, per TPU VM); `jax.distributed.initialize`
joins them into one system, after which `jax.devices()` lists the devices of every process and
one mesh spans them all. Every process runs the same program on the same inputs; only process
0 writes metrics, publishes weights and logs (`is_primary`), while orbax checkpoints are
written by all processes together.

Where the topology comes from (`resolve`, first match wins):
  1. arguments (the main job's `--coordinator_address`, `--num_processes`, `--process_id`
     flags),
  2. `ESPO_COORDINATOR`, `ESPO_NUM_PROCESSES`, `ESPO_PROCESS_ID`, `ESPO_LOCAL_DEVICE_IDS`
     (launch scripts, tests; a number of processes of 1 means a single process),
  3. `ESPO_DISTRIBUTED=auto` or a Slurm step with `SLURM_NTASKS` > 1: plain
     `jax.distributed.initialize()`, whose cluster detection reads Slurm's variables or the
     Cloud TPU metadata (`launch/tpu_multihost.sh` sets `ESPO_DISTRIBUTED=auto`),
  4. otherwise a single process: nothing to do.

Feeding the mesh: the learner's batch is sharded over rows (`data` x `fsdp`). Each process
puts only the rows its own devices hold (`jax.make_array_from_process_local_data`);
`put_batch` takes the identical host batch every process built from the shared rollout buffer
and slices out those rows, `global_from_local` takes rows a process loaded by itself;
`put_global` places weights every host read (any sharding). Processes that may see different
data (the rollout buffer while workers write) agree through `broadcast_groups` (process 0's
groups to all); `gather_to_host` brings sharded parameters to every host (before process 0
publishes them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

MODES = ("single", "explicit", "auto")
ENV_COORDINATOR = "ESPO_COORDINATOR"
ENV_NUM_PROCESSES = "ESPO_NUM_PROCESSES"
ENV_PROCESS_ID = "ESPO_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "ESPO_LOCAL_DEVICE_IDS"
ENV_AUTO = "ESPO_DISTRIBUTED"


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """How to start: `mode` "single" (no-op), "explicit" (the fields below) or "auto"
    (`jax.distributed.initialize()` detects Slurm / Cloud TPU); `source` says where from."""

    mode: str
    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None


def _int(value: Any, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _device_ids(value: Any, name: str) -> tuple[int, ...] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return tuple(_int(v, name) for v in value.split(",") if v.strip())
    if isinstance(value, int):
        return (value,)
    return tuple(_int(v, name) for v in value)


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | str | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedSpec:
    """The start-up spec from arguments, then environment (see module doc). Pure: reads `env`
    (default `os.environ`), raises ValueError naming the missing or bad setting."""
    env = os.environ if env is None else env
    given = any(v is not None for v in (coordinator_address, num_processes, process_id))
    source = "arguments" if given else "ESPO_* environment"
    coordinator = coordinator_address if given else env.get(ENV_COORDINATOR) or None
    n = num_processes if given else env.get(ENV_NUM_PROCESSES) or None
    pid = process_id if given else env.get(ENV_PROCESS_ID) or None
    ids = local_device_ids if local_device_ids is not None else env.get(ENV_LOCAL_DEVICE_IDS)
    ids = _device_ids(ids, f"local_device_ids / {ENV_LOCAL_DEVICE_IDS}")
    names = ("num_processes", "coordinator_address", "process_id") if given else (
        ENV_NUM_PROCESSES, ENV_COORDINATOR, ENV_PROCESS_ID)
    if n is not None or coordinator is not None or pid is not None:
        if n is None:
            raise ValueError(f"{names[0]} is required with {names[1]}/{names[2]} ({source})")
        n = _int(n, names[0])
        if n < 1:
            raise ValueError(f"{names[0]} must be >= 1, got {n}")
        if n == 1:
            return DistributedSpec("single", source, local_device_ids=ids)
        missing = [name for name, v in zip(names[1:], (coordinator, pid), strict=True)
                   if v is None]
        if missing:
            raise ValueError(f"{names[0]}={n} needs {' and '.join(missing)} ({source})")
        pid = _int(pid, names[2])
        if not 0 <= pid < n:
            raise ValueError(f"{names[2]}={pid} is not in [0, {n}) ({source})")
        if ":" not in str(coordinator):
            raise ValueError(f"{names[1]}={coordinator!r} must be host:port ({source})")
        return DistributedSpec("explicit", source, str(coordinator), n, pid, ids)
    auto = env.get(ENV_AUTO, "").lower()
    if auto not in ("", "0", "off", "auto", "1", "on"):
        raise ValueError(f"{ENV_AUTO}={env[ENV_AUTO]!r}: use auto (or 1/on) or off (or 0)")
    if auto in ("auto", "1", "on"):
        return DistributedSpec("auto", f"{ENV_AUTO}={env[ENV_AUTO]}", local_device_ids=ids)
    slurm_tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if slurm_tasks and "SLURM_JOB_ID" in env and _int(slurm_tasks, "SLURM_NTASKS") > 1:
        return DistributedSpec("auto", f"Slurm ({slurm_tasks} tasks)", local_device_ids=ids)
    return DistributedSpec("single", "default", local_device_ids=ids)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | str | None = None,
    *,
    initialization_timeout: int = 300,
) -> DistributedSpec:
    """Joins this process to the multi-host JAX system (see `resolve`); a no-op for a single
    process and when already initialised. Call before any JAX computation."""
    spec = resolve(coordinator_address, num_processes, process_id, local_device_ids)
    if spec.mode == "single" or jax.distributed.is_initialized():
        return spec
    kwargs: dict[str, Any] = dict(initialization_timeout=initialization_timeout)
    if spec.local_device_ids is not None:
        kwargs["local_device_ids"] = list(spec.local_device_ids)
    if spec.mode == "explicit":
        kwargs.update(coordinator_address=spec.coordinator_address,
                      num_processes=spec.num_processes, process_id=spec.process_id)
    jax.distributed.initialize(**kwargs)
    logging.info("jax.distributed (%s): process %d of %d, %d local / %d global devices",
                 spec.source, jax.process_index(), jax.process_count(),
                 jax.local_device_count(), jax.device_count())
    return spec


def is_primary() -> bool:
    """Process 0: the one that writes metrics, publishes weights and deletes consumed shards."""
    return jax.process_index() == 0


def sync(name: str, timeout_s: float = 600.0) -> None:
    """Barrier across processes (a no-op for one process), e.g. before process 0 deletes files
    that the others may still read, or before the first collective: CPU (gloo) collectives give
    up after 30 s, so processes that drift apart while compiling must meet first. Uses the
    coordination service (`timeout_s`), not a device collective; `name` must be unique per
    barrier (e.g. include the step)."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed  # the client of jax.distributed

    client = jax_distributed.global_state.client
    if client is None:  # processes joined some other way (e.g. a TPU runtime): a collective
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
        return
    client.wait_at_barrier(f"espo_jax:{name}", int(timeout_s * 1000))


def process_rows(sharding: Sharding, global_rows: int) -> slice:
    """The rows [start, stop) of a [global_rows, ...] array that this process's devices hold
    under `sharding` (the leading axis sharded, the others not). Raises if they are not one
    contiguous block (a mesh whose device order interleaves processes along the batch)."""
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    spans = sorted({(ix[0].indices(global_rows)[:2]) for ix in index_map.values()})
    start, stop = spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s != stop:
            raise ValueError(f"process {jax.process_index()} holds rows {spans} of "
                             f"{global_rows}: not one contiguous block; build the mesh with "
                             "each process's devices adjacent along the batch axes")
        stop = e
    return slice(start, stop)


def global_from_local(local_tree: Any, sharding: Sharding, global_rows: int) -> Any:
    """A pytree of global arrays [global_rows, ...] from this process's rows (the block
    `process_rows(sharding, global_rows)`) of each leaf; `None` leaves stay `None`."""

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (global_rows, *x.shape[1:]))

    return jax.tree.map(put, local_tree)


def put_batch(host_tree: Any, sharding: Sharding) -> Any:
    """Global arrays from a host pytree that every process holds in full (e.g. the learner's
    batch, built identically everywhere from the shared buffer): each process transfers only
    its own rows of each leaf (leaves may have different row counts: a packed batch's model
    rows and its sequence rows). One process: `jax.device_put`."""
    if jax.process_count() == 1:
        return jax.device_put(host_tree, sharding)

    def put(x):
        n = np.shape(x)[0]
        return global_from_local(np.asarray(x)[process_rows(sharding, n)], sharding, n)

    return jax.tree.map(put, host_tree)


def put_global(host_tree: Any, shardings: Any) -> Any:
    """Global arrays from a host pytree every process holds in full, under any shardings (a
    matching tree, or one sharding for all leaves): each process copies only the shards of its
    own devices (`jax.make_array_from_callback`). For initial weights read from a checkpoint on
    every host; unlike `jax.device_put` across processes, there is no all-gather check that the
    copies agree."""
    if jax.process_count() == 1:
        return jax.device_put(host_tree, shardings)
    if isinstance(shardings, Sharding):
        shardings = jax.tree.map(lambda _: shardings, host_tree)

    def put(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

    return jax.tree.map(put, host_tree, shardings)


def _bucket(n: int, smallest: int = 4096) -> int:
    """`n` rounded up to a power of two (at least `smallest`): few distinct shapes to compile."""
    return max(smallest, 1 << max(n - 1, 0).bit_length())


def broadcast_bytes(payload: bytes | None, chunk_bytes: int = 1 << 26) -> bytes:
    """Process 0's `payload` on every process (the others pass None). A collective, in chunks
    of at most `chunk_bytes` (power-of-two sized, so few programs compile); one process:
    `payload` itself."""
    primary = is_primary()
    if primary and payload is None:
        raise ValueError("broadcast_bytes: process 0 must pass the payload")
    if jax.process_count() == 1:
        return payload
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(payload) if primary else 0)))
    out = bytearray()
    for start in range(0, n, chunk_bytes):
        size = min(chunk_bytes, n - start)
        chunk = np.zeros(_bucket(size), np.uint8)
        if primary:
            chunk[:size] = np.frombuffer(payload, np.uint8, size, start)
        out += np.asarray(multihost_utils.broadcast_one_to_all(chunk))[:size].tobytes()
    return bytes(out)


def broadcast_groups(groups: Sequence[Any] | None) -> list[Any]:
    """Process 0's rollout groups on every process (the others pass None), so that all learner
    processes train on the same batch even when they would see the buffer at different moments.
    Groups travel as buffer records (`espo_jax.buffer.records`)."""
    from espo_jax.buffer import records

    if jax.process_count() == 1:
        return list(groups)
    payload = None
    if is_primary():
        if groups is None:
            raise ValueError("broadcast_groups: process 0 must pass the groups")
        parts = [records.encode(g) for g in groups]
        payload = b"".join(len(p).to_bytes(8, "little") + p for p in parts)
    data = broadcast_bytes(payload)
    out, pos = [], 0
    while pos < len(data):
        size = int.from_bytes(data[pos:pos + 8], "little")
        out.append(records.decode(data[pos + 8:pos + 8 + size]))
        pos += 8 + size
    return out


def gather_to_host(tree: Any) -> Any:
    """Numpy copies of (possibly multi-process) global arrays on every process. A collective:
    every process must call it (e.g. before process 0 publishes weights)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


__all__ = [
    "DistributedSpec", "broadcast_bytes", "broadcast_groups", "gather_to_host",
    "global_from_local", "initialize", "is_primary", "process_rows", "put_batch", "put_global",
    "resolve", "sync",
]
