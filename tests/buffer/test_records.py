"""Rollout records: round trips over dtypes and edge sizes, and clear errors for bad bytes."""

import struct
import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from espo_jax.buffer import records
from espo_jax.buffer.records import RecordDecodeError, Response, RolloutGroup, decode, encode


def make_group(lengths, prompt_len=5, n_experts=None, moe_layers=2, top_k=2, seed=0):
    """A scored group with one response per entry of `lengths` (routing when n_experts)."""
    rng = np.random.default_rng(seed)
    responses = []
    for i, t in enumerate(lengths):
        routed = None
        if n_experts is not None:
            routed = rng.integers(0, n_experts, size=(prompt_len + t, moe_layers, top_k))
            routed[-1:] = -1  # the last sampled token was never fed forward: no routing
        responses.append(
            Response(
                tokens=rng.integers(0, 50_000, size=t),
                logprobs=-rng.random(t),
                routed_experts=routed,
                finish_reason=("stop", "length", "abort")[i % 3],
                outcome=i % 2 == 0,
                reward=float(i) - 0.25,
                reward_components={"correct": float(i % 2 == 0), "length": -0.01 * t},
            )
        )
    return RolloutGroup(
        prompt_id=f"prompt-{seed}",
        prompt_tokens=rng.integers(0, 50_000, size=prompt_len),
        policy_version=7,
        sampler="jax-fp8",
        created_at=1_700_000_000.125,
        rewarded_at=1_700_000_001.5,
        meta={"dataset": "chain_sum", "answer": "42", "params": {"temperature": 1.0}},
        responses=responses,
        n_experts=n_experts,
    )


def roundtrip(group):
    back = decode(encode(group))
    assert back == group
    return back


@pytest.mark.parametrize("n_experts", [None, 8, 255, 256, 300, 32767])
@pytest.mark.parametrize("lengths", [[], [0], [1], [0, 1, 3], [4096]])
def test_roundtrip_routing_dtypes_and_edge_sizes(n_experts, lengths):
    group = make_group(lengths, n_experts=n_experts, seed=len(lengths))
    back = roundtrip(group)
    assert back.num_responses == len(lengths)
    assert back.response_lengths.tolist() == lengths
    for r in back.responses:
        assert r.tokens.dtype == np.int32 and r.logprobs.dtype == np.float32
        if n_experts is None:
            assert r.routed_experts is None
        else:
            assert r.routed_experts.dtype == np.int16
            assert (r.routed_experts[-1] == -1).all()  # the sentinel comes back as -1


def test_top_expert_index_and_sentinel_are_distinct_on_disk():
    # 255 experts: indices 0..254 and the sentinel 255 fit uint8. 256 experts: index 255 is a
    # real expert, so the record switches to int16 and both 255 and -1 survive.
    assert records.routed_experts_disk_dtype(255) == np.uint8
    assert records.routed_experts_disk_dtype(256) == np.int16
    for n_experts in (255, 256):
        group = make_group([2], prompt_len=1, n_experts=n_experts, moe_layers=1, top_k=2)
        top = n_experts - 1
        group.responses[0].routed_experts = np.array([[[top, -1]], [[0, top]], [[-1, -1]]])
        back = roundtrip(group)
        assert back.responses[0].routed_experts.tolist() == [[[top, -1]], [[0, top]], [[-1, -1]]]


def test_uint8_routing_is_half_the_bytes_of_int16():
    # One response, P=20, T=12, 4 layers x top-2: (20 + 12) * 4 * 2 = 256 routing entries:
    # 256 bytes as uint8 vs 512 as int16 (both msgpack bin16, same 3-byte header). n_experts
    # 200 packs as msgpack uint8 (2 bytes), 300 as uint16 (3 bytes): 256 + 1 = 257 bytes more.
    small = make_group([12], prompt_len=20, n_experts=200, moe_layers=4, top_k=2)
    big = make_group([12], prompt_len=20, n_experts=200, moe_layers=4, top_k=2)
    big.n_experts = 300
    assert len(encode(big)) - len(encode(small)) == 257


def test_helpers():
    group = make_group([3, 0, 2])
    assert group.num_responses == 3 and group.prompt_length == 5
    assert group.response_lengths.tolist() == [3, 0, 2]
    assert group.outcomes.tolist() == [1.0, 0.0, 1.0]  # outcome = (i % 2 == 0)
    assert group.rewards.tolist() == [-0.25, 0.75, 1.75]  # reward = i - 0.25
    assert all(r.routed_experts is None for r in group.responses)
    group.responses[1].outcome = None
    group.responses[2].reward = None
    assert group.outcomes is None and group.rewards is None
    assert roundtrip(group).responses[1].outcome is None  # unscored survives encoding


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), max_size=5),
    prompt_len=st.integers(0, 30),
    n_experts=st.one_of(st.none(), st.integers(1, 1000)),
    moe_layers=st.integers(1, 3),
    top_k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_property(lengths, prompt_len, n_experts, moe_layers, top_k, seed):
    roundtrip(make_group(lengths, prompt_len, n_experts, moe_layers, top_k, seed))


def _fields(data: bytes) -> dict:
    return msgpack.unpackb(data[14:], raw=False, strict_map_key=False)  # 14 = 4+2+4+4 header


def _reframe(fields: dict) -> bytes:
    return records.pack_payload(msgpack.packb(fields, use_bin_type=True))


def test_decode_errors_say_what_is_wrong():
    data = encode(make_group([4, 2], n_experts=16))
    with pytest.raises(RecordDecodeError, match="shorter than the 14-byte header"):
        decode(data[:10])
    with pytest.raises(RecordDecodeError, match=f"truncated: header says {len(data) - 14}"):
        decode(data[:-1])
    with pytest.raises(RecordDecodeError, match="trailing bytes"):
        decode(data + b"\0")
    with pytest.raises(RecordDecodeError, match="not a rollout record"):
        decode(b"XXXX" + data[4:])
    bumped = struct.pack("<4sH", b"ESPR", 2) + data[6:]
    with pytest.raises(RecordDecodeError, match="schema_version 2 not supported .*reads 1"):
        decode(bumped)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    with pytest.raises(RecordDecodeError, match="checksum mismatch"):
        decode(bytes(flipped))
    garbage = b"\xc1" * 20  # 0xc1 is never used in msgpack
    bad_payload = struct.pack("<4sHII", b"ESPR", 1, 20, zlib.crc32(garbage)) + garbage
    with pytest.raises(RecordDecodeError, match="malformed payload"):
        decode(bad_payload)


def test_decode_rejects_wrong_shapes_behind_a_valid_checksum():
    data = encode(make_group([4, 2], prompt_len=5, n_experts=16))

    def broken(edit):
        fields = _fields(data)
        edit(fields)
        return _reframe(fields)

    def drop_logprob(f):
        f["responses"][0]["logprobs"] = f["responses"][0]["logprobs"][:-4]

    with pytest.raises(RecordDecodeError, match=r"responses\[0\].logprobs has shape \(3,\)"):
        decode(broken(drop_logprob))

    def odd_tokens(f):
        f["responses"][1]["tokens"] += b"\0"

    with pytest.raises(RecordDecodeError, match="9 bytes is not a whole number of <i4"):
        decode(broken(odd_tokens))

    def wrong_routing_shape(f):
        f["responses"][1]["routed_experts"][0] = [8, 2, 1]  # 8*2*1 = 16 values, 7*2*2 = 28 there

    with pytest.raises(RecordDecodeError, match="28 values do not fill shape"):
        decode(broken(wrong_routing_shape))

    def routing_for_wrong_length(f):
        f["responses"][1]["routed_experts"][0] = [14, 1, 2]  # 28 values, but P + T = 5 + 2 = 7

    with pytest.raises(RecordDecodeError, match=r"shape \(14, 1, 2\), expected .* = 7"):
        decode(broken(routing_for_wrong_length))

    def missing_field(f):
        del f["policy_version"]

    with pytest.raises(RecordDecodeError, match="malformed payload: KeyError"):
        decode(broken(missing_field))


def test_encode_rejects_bad_groups():
    with pytest.raises(ValueError, match="tokens must hold integers"):
        Response(tokens=np.array([1.5]), logprobs=[0.0])
    group = make_group([3], n_experts=8)
    group.responses[0].finish_reason = "eos"
    with pytest.raises(ValueError, match="finish_reason 'eos' not in"):
        encode(group)
    group = make_group([3], n_experts=8)
    group.responses[0].routed_experts[0, 0, 0] = 8
    with pytest.raises(ValueError, match=r"values \[-1, 8\] outside \[-1, n_experts=8\)"):
        encode(group)
    group.n_experts = None
    with pytest.raises(ValueError, match="n_experts is None"):
        encode(group)
    group = make_group([3])
    group.responses[0].logprobs = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="one log-prob per sampled token"):
        encode(group)
    group = make_group([3])
    group.meta = {"labels": {1, 2}}
    with pytest.raises(ValueError, match="meta is not JSON-able"):
        encode(group)
    group = make_group([3])
    group.responses[0].tokens = [1, 2, 3]  # assigned after construction: no conversion
    with pytest.raises(ValueError, match=r"responses\[0\].tokens must be a numpy array"):
        encode(group)
    group.responses[0].tokens = np.array([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="tokens has dtype float64, expected int"):
        encode(group)
    group = make_group([3])
    group.responses[0].outcome = 0.5
    with pytest.raises(ValueError, match="outcome must be 0/1"):
        encode(group)
