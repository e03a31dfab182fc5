"""The published-weights directory: how the learner hands policy weights to rollout workers.

Layout (one immutable directory per version, never modified after it appears):

    <directory>/v00000007/config.json      the ModelConfig, as JSON
                         params.msgpack    the float parameters (flax.serialization msgpack)
                         meta.json         version, created_at, format
                         hf/               optional Hugging Face export (vLLM workers)
                         COMMITTED         written last: the version is complete

`publish` writes everything under a temporary name, fsyncs the files, writes COMMITTED,
renames the directory to its final name and fsyncs the parent: a reader sees a whole version or
none (a local rename is atomic; on a bucket, where rename is copy-and-delete, COMMITTED is the
gate). `latest` returns the newest committed version; `load` reads one. Old versions beyond
`keep` are deleted by the publisher; a worker that loses the race for a version it was about to
read gets FileNotFoundError and asks `latest` again.

Paths go through `etils.epath`, so a bucket works like a local directory. No JAX: the config is
any dataclass or mapping (stored as JSON, returned as a dict) and the parameters a nested dict of
arrays (numpy, or anything `np.asarray` takes), stored in flax.serialization's msgpack layout
(`flax.serialization.msgpack_restore` reads the file and vice versa).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
from etils import epath

FORMAT = "espo_jax.weights/1"
COMMITTED = "COMMITTED"
_VERSION_RE = re.compile(r"^v(\d{8})$")
_TMP_PREFIX = ".tmp-"
_NDARRAY_EXT, _SCALAR_EXT = 1, 3  # flax.serialization's msgpack codes: ndarray, numpy scalar
_MAX_LEAF_BYTES = 2**31 - 1  # msgpack's limit for one binary object


def pack_params(params: Mapping) -> bytes:
    """A nested dict of arrays as msgpack bytes (each array: shape, dtype name, C-order bytes)."""

    def leaf(x):
        arr = np.ascontiguousarray(np.asarray(x))
        if arr.dtype.hasobject or arr.nbytes > _MAX_LEAF_BYTES:
            raise ValueError(f"cannot store a parameter of dtype {arr.dtype} and {arr.nbytes} "
                             f"bytes (numeric arrays under {_MAX_LEAF_BYTES} bytes only)")
        payload = msgpack.packb((arr.shape, arr.dtype.name, arr.tobytes("C")), use_bin_type=True)
        return msgpack.ExtType(_SCALAR_EXT if isinstance(x, np.generic) else _NDARRAY_EXT, payload)

    def tree(node):
        if isinstance(node, Mapping):
            return {str(k): tree(v) for k, v in node.items()}
        return leaf(node)

    return msgpack.packb(tree(params), use_bin_type=True)


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def unpack_params(data: bytes) -> dict[str, Any]:
    """The nested dict of numpy arrays that `pack_params` wrote."""

    def ext(code: int, payload: bytes):
        if code not in (_NDARRAY_EXT, _SCALAR_EXT):
            raise ValueError(f"unknown msgpack extension {code} in a parameter file")
        shape, dtype, raw = msgpack.unpackb(payload, raw=False)
        arr = np.frombuffer(raw, dtype=_dtype(dtype)).reshape(shape)
        return arr[()] if code == _SCALAR_EXT else arr

    return msgpack.unpackb(data, ext_hook=ext, raw=False, strict_map_key=False)


def version_dir(directory: epath.PathLike, version: int) -> epath.Path:
    return epath.Path(directory) / f"v{version:08d}"


def _write(path: epath.Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        if hasattr(f, "fileno"):  # local file: make it durable before the rename
            f.flush()
            os.fsync(f.fileno())


def _fsync_dir(path: epath.Path) -> None:
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except (OSError, TypeError):  # not a local directory (bucket)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(
    directory: epath.PathLike,
    version: int,
    config: Any,
    params: Mapping,
    *,
    keep: int | None = 3,
    hf_export: Callable[[str], None] | None = None,
    stale_tmp_age_s: float = 3600.0,
) -> epath.Path:
    """Writes `params` as version `version` (see module doc); returns its directory.

    `config`: the model config, a dataclass or a mapping. Versions are immutable: publishing an
    existing one raises. `keep`: committed versions to retain (oldest deleted first, never the
    one just written; None keeps all). `hf_export(path)`: writes the Hugging Face export for
    vLLM workers at `path` (`<version>/hf`), e.g. `functools.partial(hf_io.save_pretrained,
    model_config, params)`.
    """
    if not isinstance(version, int) or not 0 <= version < 10**8:
        raise ValueError(f"version must be an int in [0, 1e8), got {version!r}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = version_dir(directory, version)
    if final.exists():
        raise FileExistsError(f"weights version {version} already published at {final}")
    _remove_stale_tmp(directory, stale_tmp_age_s)
    tmp = directory / f"{_TMP_PREFIX}v{version:08d}-{os.getpid()}-{secrets.token_hex(3)}"
    tmp.mkdir()
    config = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    _write(tmp / "config.json", json.dumps(config, indent=1).encode())
    _write(tmp / "params.msgpack", pack_params(params))
    meta = {"format": FORMAT, "version": version, "created_at": time.time()}
    _write(tmp / "meta.json", json.dumps(meta).encode())
    if hf_export is not None:
        hf_export(os.fspath(tmp / "hf"))
    _write(tmp / COMMITTED, b"")
    _fsync_dir(tmp)
    tmp.rename(final)
    _fsync_dir(directory)
    if keep is not None:
        for old, path in versions(directory)[:-keep]:
            if old != version:
                try:
                    path.rmtree()
                except FileNotFoundError:  # another publisher's retention got there first
                    pass
    return final


def _remove_stale_tmp(directory: epath.Path, age_s: float) -> None:
    """Deletes temporary version directories of publishers that died `age_s` seconds ago."""
    now = time.time()
    for p in directory.iterdir():
        if p.name.startswith(_TMP_PREFIX):
            try:
                if now - p.stat().mtime > age_s:
                    p.rmtree()
            except FileNotFoundError:
                pass


def versions(directory: epath.PathLike) -> list[tuple[int, epath.Path]]:
    """Committed versions in `directory`, oldest first."""
    directory = epath.Path(directory)
    if not directory.exists():
        return []
    out = []
    for p in directory.iterdir():
        m = _VERSION_RE.match(p.name)
        if m and (p / COMMITTED).exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(directory: epath.PathLike) -> tuple[int, epath.Path] | None:
    """The newest committed `(version, path)`, or None when nothing is published yet."""
    found = versions(directory)
    return found[-1] if found else None


def load_config(path: epath.PathLike) -> dict[str, Any]:
    """The model config dict of one published version, without reading its parameters."""
    path = epath.Path(path)
    if not (path / COMMITTED).exists():
        raise FileNotFoundError(f"{path} is not a committed weights version (no {COMMITTED})")
    return json.loads((path / "config.json").read_text())


def load(path: epath.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(config dict, params)` of one published version; params are numpy arrays."""
    path = epath.Path(path)
    if not (path / COMMITTED).exists():
        raise FileNotFoundError(f"{path} is not a committed weights version (no {COMMITTED})")
    config = json.loads((path / "config.json").read_text())
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: weights format {meta.get('format')!r}, expected {FORMAT!r}")
    params = unpack_params((path / "params.msgpack").read_bytes())
    if not isinstance(params, dict) or not params:
        raise ValueError(f"{path}/params.msgpack holds no parameter arrays")
    return config, params
