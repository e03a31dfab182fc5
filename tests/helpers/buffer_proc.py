"""Writer and reader processes for the rollout buffer tests (no JAX: they start in ~0.3 s).

python buffer_proc.py write DIR WRITER_ID TAG N PER_SHARD SLEEP_S
    prints "ready", writes groups make_group(TAG, 0..N-1) with SLEEP_S between writes,
    closes, prints "done".
python buffer_proc.py read DIR CURSOR_IN OUT
    reads every finished group after the cursor in CURSOR_IN (a JSON file, or "none") and
    writes {"ids": [[tag, k], ...], "cursor": ...} to OUT.
"""

import json
import sys
import time

import numpy as np

from espo_jax.buffer import BufferReader, BufferWriter
from espo_jax.buffer.records import Response, RolloutGroup


def make_group(tag: int, k: int, policy_version: int = 0) -> RolloutGroup:
    """Group k of writer `tag`; its contents are a function of (tag, k) so any damage shows."""
    rng = np.random.default_rng(tag * 1_000_003 + k)
    lengths = rng.integers(0, 30, size=4)
    responses = [
        Response(
            tokens=rng.integers(0, 1000, size=t),
            logprobs=-rng.random(t).astype(np.float32),
            routed_experts=rng.integers(-1, 8, size=(3 + t, 2, 2)),
            finish_reason="stop",
            outcome=int(t % 2),
            reward=float(t),
        )
        for t in lengths
    ]
    return RolloutGroup(
        prompt_id=f"{tag}:{k}",
        prompt_tokens=rng.integers(0, 1000, size=3),
        policy_version=policy_version,
        sampler="test-fp32",
        created_at=1000.0 + k,
        meta={"tag": tag, "k": k},
        responses=responses,
        n_experts=8,
    )


def ids(groups: list[RolloutGroup]) -> list[list[int]]:
    return [[g.meta["tag"], g.meta["k"]] for g in groups]


def main(argv: list[str]) -> None:
    if argv[0] == "write":
        directory, writer_id, tag, n, per_shard, sleep_s = argv[1:]
        writer = BufferWriter(directory, writer_id, max_records_per_shard=int(per_shard))
        print("ready", flush=True)
        for k in range(int(n)):
            writer.write(make_group(int(tag), k))
            time.sleep(float(sleep_s))
        writer.close()
        print("done", flush=True)
    elif argv[0] == "read":
        directory, cursor_in, out = argv[1:]
        cursor = None if cursor_in == "none" else json.load(open(cursor_in))
        reader = BufferReader(directory, cursor=cursor)
        groups = reader.read(10**6, timeout_s=0)
        with open(out, "w") as f:
            json.dump({"ids": ids(groups), "cursor": reader.cursor}, f)
    else:
        raise SystemExit(f"unknown command {argv[0]!r}: write | read")


if __name__ == "__main__":
    main(sys.argv[1:])
