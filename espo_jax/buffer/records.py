"""One rollout record: a prompt group (one prompt, its G responses), encoded to bytes and back.

The rollout side (embedded JAX engine, vLLM worker) builds `RolloutGroup`s; the buffer
(`espo_jax.buffer`) stores one encoded group per ArrayRecord record; the learner decodes
them. The record is self-describing and versioned, and `decode` checks everything before it
returns, so a damaged or foreign record is never silently used.

Wire format (all little-endian):

    magic b"ESPR" | schema_version u16 | payload_len u32 | crc32(payload) u32 | payload

The payload is msgpack: a map of the group fields; arrays travel as raw bytes with their dtype
fixed by the schema (tokens int32, logprobs float32, routed experts uint8 or int16).

Routed experts: in memory an integer array `[prompt + response tokens, moe_layers, top_k]` with
-1 where a position has no routing (e.g. the last sampled token, which was never fed forward).
On disk they are uint8 when the group's `n_experts` <= 255 (sentinel 255) and int16 otherwise
(sentinel -1): 256 experts leave no free uint8 value for the sentinel. `decode` returns int16
arrays with -1 restored.

This module does not import JAX (rollout worker processes start fast).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
import zlib
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1
MAGIC = b"ESPR"
FINISH_REASONS = ("stop", "length", "abort")
_HEADER = struct.Struct("<4sHII")  # magic, schema_version, payload_len, crc32
_ROUTED_DTYPE_IN_MEMORY = np.int16


class RecordDecodeError(ValueError):
    """A record could not be decoded; the message says what is wrong."""


def routed_experts_disk_dtype(n_experts: int) -> np.dtype:
    """On-disk dtype of expert indices: uint8 (sentinel 255) up to 255 experts, else int16."""
    if n_experts < 1:
        raise ValueError(f"n_experts must be >= 1, got {n_experts}")
    if n_experts <= 255:
        return np.dtype(np.uint8)
    if n_experts <= 32767:
        return np.dtype(np.int16)
    raise ValueError(f"n_experts={n_experts} does not fit int16 expert indices (max 32767)")


@dataclasses.dataclass(eq=False)
class Response:
    """One sampled response of a prompt group.

    Attributes:
      tokens: int32 [T] sampled token ids (T may be 0).
      logprobs: float32 [T] behaviour-policy log-probs of the sampled tokens.
      routed_experts: int [P + T, moe_layers, top_k] experts used per token and MoE layer, -1 where
        none; None for dense models.
      finish_reason: "stop" | "length" | "abort".
      outcome: binary verified result (bool or 0/1); None before scoring.
      reward: scalar reward (shaped); None before scoring.
      reward_components: named parts of the reward, e.g. {"correct": 1.0, "length": -0.1}.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray | None = None
    finish_reason: str = "stop"
    outcome: bool | int | None = None
    reward: float | None = None
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.tokens = _as_int_array(self.tokens, np.int32, "tokens")
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        if self.routed_experts is not None:
            self.routed_experts = _as_int_array(
                self.routed_experts, _ROUTED_DTYPE_IN_MEMORY, "routed_experts"
            )

    @property
    def length(self) -> int:
        """Number of response tokens T."""
        return int(self.tokens.shape[0])

    def __eq__(self, other: object) -> bool:
        """Equal fields; arrays compare by shape and values (not dtype)."""
        if not isinstance(other, Response):
            return NotImplemented
        return (
            _arrays_equal(self.tokens, other.tokens)
            and _arrays_equal(self.logprobs, other.logprobs)
            and _arrays_equal(self.routed_experts, other.routed_experts)
            and self.finish_reason == other.finish_reason
            and self.outcome == other.outcome
            and self.reward == other.reward
            and self.reward_components == other.reward_components
        )


@dataclasses.dataclass(eq=False)
class RolloutGroup:
    """One prompt and its G responses: the unit the buffer stores and the learner filters.

    Attributes:
      prompt_id: stable id of the prompt (str or int) for history, retirement and dedup.
      prompt_tokens: int32 [P] prompt token ids.
      policy_version: version of the weights that sampled the responses (staleness).
      sampler: engine name and precision, e.g. "jax-fp32", "jax-fp8", "vllm-fp8".
      created_at: unix seconds when generation finished.
      rewarded_at: unix seconds when rewards were attached; None before scoring.
      meta: JSON-able extra fields (dataset, answer, sampling params, ...).
      responses: the G responses.
      n_experts: experts per MoE layer of the sampling model; sets the on-disk dtype of
        routed experts. None for dense models (then no response may carry routing).
    """

    prompt_id: str | int
    prompt_tokens: np.ndarray
    policy_version: int
    sampler: str
    created_at: float
    rewarded_at: float | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    responses: list[Response] = dataclasses.field(default_factory=list)
    n_experts: int | None = None

    def __post_init__(self):
        self.prompt_tokens = _as_int_array(self.prompt_tokens, np.int32, "prompt_tokens")
        self.responses = list(self.responses)

    @property
    def num_responses(self) -> int:
        """G, the number of responses."""
        return len(self.responses)

    @property
    def prompt_length(self) -> int:
        """P, the number of prompt tokens."""
        return int(self.prompt_tokens.shape[0])

    @property
    def response_lengths(self) -> np.ndarray:
        """int32 [G] response lengths."""
        return np.array([r.length for r in self.responses], dtype=np.int32)

    @property
    def outcomes(self) -> np.ndarray | None:
        """float32 [G] binary outcomes (0/1), or None while any response is unscored."""
        if any(r.outcome is None for r in self.responses):
            return None
        return np.array([float(r.outcome) for r in self.responses], dtype=np.float32)

    @property
    def rewards(self) -> np.ndarray | None:
        """float32 [G] rewards, or None while any response is unscored."""
        if any(r.reward is None for r in self.responses):
            return None
        return np.array([r.reward for r in self.responses], dtype=np.float32)

    @property
    def step_credits(self) -> np.ndarray:
        """float32 [G] `reward_components["step_credit"]` (0 where a response has none): the
        score MS-ZVE's tie-break ranks wrong responses by (`zve.tie_break.wrong_score`)."""
        return np.array([r.reward_components.get("step_credit", 0.0) for r in self.responses],
                        dtype=np.float32)

    def __eq__(self, other: object) -> bool:
        """Equal fields; arrays compare by shape and values (not dtype)."""
        if not isinstance(other, RolloutGroup):
            return NotImplemented
        return (
            self.prompt_id == other.prompt_id
            and _arrays_equal(self.prompt_tokens, other.prompt_tokens)
            and self.policy_version == other.policy_version
            and self.sampler == other.sampler
            and self.created_at == other.created_at
            and self.rewarded_at == other.rewarded_at
            and self.meta == other.meta
            and self.n_experts == other.n_experts
            and self.responses == other.responses
        )

    def validate(self) -> None:
        """Raises ValueError naming the first field that breaks the record's contract."""
        _check_group(self, ValueError)


def _as_int_array(x: Any, dtype: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == dtype:
        return arr
    if arr.size == 0:
        return arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    info = np.iinfo(dtype)
    if arr.min() < info.min or arr.max() > info.max:
        raise ValueError(f"{name} values [{arr.min()}, {arr.max()}] do not fit {np.dtype(dtype)}")
    return arr.astype(dtype, copy=False)


def _arrays_equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _check_group(g: RolloutGroup, error: type[Exception]) -> None:
    """Checks every field; raises `error` with the field path and what is wrong."""
    if not isinstance(g.prompt_id, (str, numbers.Integral)) or isinstance(g.prompt_id, bool):
        raise error(f"prompt_id must be str or int, got {type(g.prompt_id).__name__}")
    arrays = [("prompt_tokens", g.prompt_tokens)]
    for i, r in enumerate(g.responses):
        arrays += [(f"responses[{i}].{k}", getattr(r, k, None)) for k in ("tokens", "logprobs")]
        if getattr(r, "routed_experts", None) is not None:
            arrays.append((f"responses[{i}].routed_experts", r.routed_experts))
    for name, x in arrays:
        if not isinstance(x, np.ndarray):
            raise error(f"{name} must be a numpy array, got {type(x).__name__}")
        kinds = "f" if name.endswith("logprobs") else "iu"
        if x.dtype.kind not in kinds:
            raise error(
                f"{name} has dtype {x.dtype}, expected {'float' if kinds == 'f' else 'int'}"
            )
    if g.prompt_tokens.ndim != 1:
        raise error(f"prompt_tokens must be 1-D, got shape {g.prompt_tokens.shape}")
    if not isinstance(g.policy_version, numbers.Integral) or g.policy_version < 0:
        raise error(f"policy_version must be an int >= 0, got {g.policy_version!r}")
    if not isinstance(g.sampler, str):
        raise error(f"sampler must be a str, got {type(g.sampler).__name__}")
    for name in ("created_at", "rewarded_at"):
        value = getattr(g, name)
        if value is None and name == "rewarded_at":
            continue
        if not _is_real(value) or math.isnan(value):
            raise error(f"{name} must be unix seconds (float), got {value!r}")
    if not isinstance(g.meta, dict):
        raise error(f"meta must be a dict, got {type(g.meta).__name__}")
    if g.n_experts is not None:
        try:
            routed_experts_disk_dtype(g.n_experts)
        except (ValueError, TypeError) as e:
            raise error(f"n_experts: {e}") from None
    routed_shape = None
    for i, r in enumerate(g.responses):
        where = f"responses[{i}]"
        if not isinstance(r, Response):
            raise error(f"{where} must be a Response, got {type(r).__name__}")
        if r.tokens.ndim != 1:
            raise error(f"{where}.tokens must be 1-D, got shape {r.tokens.shape}")
        if r.logprobs.shape != r.tokens.shape:
            raise error(
                f"{where}.logprobs has shape {r.logprobs.shape}, tokens {r.tokens.shape}: "
                "one log-prob per sampled token"
            )
        if r.finish_reason not in FINISH_REASONS:
            raise error(f"{where}.finish_reason {r.finish_reason!r} not in {FINISH_REASONS}")
        if r.outcome is not None and r.outcome not in (0, 1):
            raise error(f"{where}.outcome must be 0/1/True/False or None, got {r.outcome!r}")
        if r.reward is not None and not _is_real(r.reward):
            raise error(f"{where}.reward must be a float or None, got {r.reward!r}")
        if not isinstance(r.reward_components, dict) or not all(
            isinstance(k, str) and _is_real(v) for k, v in r.reward_components.items()
        ):
            raise error(f"{where}.reward_components must map str to float")
        x = r.routed_experts
        if x is None:
            continue
        if g.n_experts is None:
            raise error(f"{where}.routed_experts given but the group's n_experts is None")
        expected_tokens = g.prompt_length + r.length
        if x.ndim != 3 or x.shape[0] != expected_tokens:
            raise error(
                f"{where}.routed_experts shape {x.shape}, expected "
                f"[prompt + response tokens = {expected_tokens}, moe_layers, top_k]"
            )
        if routed_shape is not None and x.shape[1:] != routed_shape:
            raise error(
                f"{where}.routed_experts has [moe_layers, top_k] = {x.shape[1:]}, "
                f"responses[0] has {routed_shape}"
            )
        routed_shape = x.shape[1:]
        if x.size and (x.min() < -1 or x.max() >= g.n_experts):
            raise error(
                f"{where}.routed_experts values [{x.min()}, {x.max()}] outside "
                f"[-1, n_experts={g.n_experts})"
            )


def encode(group: RolloutGroup) -> bytes:
    """Bytes of one record (header + checksummed msgpack payload); validates the group first."""
    group.validate()
    disk_dtype = None if group.n_experts is None else routed_experts_disk_dtype(group.n_experts)
    responses = []
    for r in group.responses:
        routed = None
        if r.routed_experts is not None:
            x = r.routed_experts
            if disk_dtype == np.uint8:
                x = np.where(x < 0, 255, x)
            routed = [list(x.shape), np.ascontiguousarray(x, dtype=disk_dtype).tobytes()]
        responses.append(
            {
                "tokens": r.tokens.astype("<i4", copy=False).tobytes(),
                "logprobs": r.logprobs.astype("<f4", copy=False).tobytes(),
                "routed_experts": routed,
                "finish_reason": r.finish_reason,
                "outcome": None if r.outcome is None else int(r.outcome),
                "reward": None if r.reward is None else float(r.reward),
                "reward_components": {k: float(v) for k, v in r.reward_components.items()},
            }
        )
    fields = {
        "prompt_id": group.prompt_id if isinstance(group.prompt_id, str) else int(group.prompt_id),
        "prompt_tokens": group.prompt_tokens.astype("<i4", copy=False).tobytes(),
        "policy_version": int(group.policy_version),
        "sampler": group.sampler,
        "created_at": float(group.created_at),
        "rewarded_at": None if group.rewarded_at is None else float(group.rewarded_at),
        "meta": group.meta,
        "n_experts": None if group.n_experts is None else int(group.n_experts),
        "responses": responses,
    }
    try:
        payload = msgpack.packb(fields, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"meta is not JSON-able (msgpack says: {e})") from None
    return pack_payload(payload)


def pack_payload(payload: bytes, schema_version: int = SCHEMA_VERSION) -> bytes:
    """Frames a msgpack payload with magic, schema version, length and crc32."""
    return _HEADER.pack(MAGIC, schema_version, len(payload), zlib.crc32(payload)) + payload


def decode(data: bytes) -> RolloutGroup:
    """The group in `data`; raises RecordDecodeError saying what is wrong with malformed bytes."""
    data = memoryview(data)
    if bytes(data[:4]) != MAGIC[: len(data)]:
        raise RecordDecodeError(
            f"not a rollout record: starts {bytes(data[:4])!r}, expected magic {MAGIC!r}"
        )
    if len(data) < _HEADER.size:
        raise RecordDecodeError(
            f"record truncated: {len(data)} bytes, shorter than the {_HEADER.size}-byte header"
        )
    _, version, payload_len, crc = _HEADER.unpack_from(data)
    if version != SCHEMA_VERSION:
        raise RecordDecodeError(
            f"schema_version {version} not supported (this code reads {SCHEMA_VERSION})"
        )
    payload = data[_HEADER.size :]
    if len(payload) != payload_len:
        what = "truncated" if len(payload) < payload_len else "has trailing bytes"
        raise RecordDecodeError(
            f"record {what}: header says {payload_len} payload bytes, got {len(payload)}"
        )
    if zlib.crc32(payload) != crc:
        raise RecordDecodeError(
            f"checksum mismatch: stored crc32 {crc:#010x}, computed {zlib.crc32(payload):#010x}"
        )
    try:
        fields = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        group = _group_from_fields(fields)
    except RecordDecodeError:
        raise
    except Exception as e:  # msgpack errors, missing keys, bad types: all mean a bad record.
        raise RecordDecodeError(f"malformed payload: {type(e).__name__}: {e}") from None
    _check_group(group, RecordDecodeError)
    return group


def _array(buf: bytes, dtype: str, name: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(buf) % itemsize:
        raise RecordDecodeError(f"{name}: {len(buf)} bytes is not a whole number of {dtype} items")
    return np.frombuffer(buf, dtype=dtype).copy()


def _group_from_fields(f: dict) -> RolloutGroup:
    n_experts = f["n_experts"]
    disk_dtype = None if n_experts is None else routed_experts_disk_dtype(n_experts)
    responses = []
    for i, r in enumerate(f["responses"]):
        routed = None
        if r["routed_experts"] is not None:
            if disk_dtype is None:
                raise RecordDecodeError(
                    f"responses[{i}].routed_experts present but n_experts is None"
                )
            shape, buf = r["routed_experts"]
            flat = _array(buf, disk_dtype.str, f"responses[{i}].routed_experts")
            if len(shape) != 3 or flat.size != math.prod(shape):
                raise RecordDecodeError(
                    f"responses[{i}].routed_experts: {flat.size} values do not fill shape {shape}"
                )
            if disk_dtype == np.uint8:
                flat = np.where(flat == 255, np.int16(-1), flat.astype(np.int16))
            routed = flat.reshape(shape).astype(_ROUTED_DTYPE_IN_MEMORY, copy=False)
        responses.append(
            Response(
                tokens=_array(r["tokens"], "<i4", f"responses[{i}].tokens"),
                logprobs=_array(r["logprobs"], "<f4", f"responses[{i}].logprobs"),
                routed_experts=routed,
                finish_reason=r["finish_reason"],
                outcome=r["outcome"],
                reward=r["reward"],
                reward_components=r["reward_components"],
            )
        )
    return RolloutGroup(
        prompt_id=f["prompt_id"],
        prompt_tokens=_array(f["prompt_tokens"], "<i4", "prompt_tokens"),
        policy_version=f["policy_version"],
        sampler=f["sampler"],
        created_at=f["created_at"],
        rewarded_at=f["rewarded_at"],
        meta=f["meta"],
        responses=responses,
        n_experts=n_experts,
    )
