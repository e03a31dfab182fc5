"""The contract where rollout workers and the learner meet: a directory of rollout records and a
directory of published weights (local disk, NFS, or a bucket through `etils.epath`).

    records.py   one prompt group (`RolloutGroup`, its `Response`s), encoded and checksummed
    shards.py    shard file names, listing, opening (ArrayRecord, one record per chunk)
    writer.py    `BufferWriter`: one stream of shards, crash-safe (tmp name, fsync, rename)
    reader.py    `BufferReader`: every stream, exactly once, with a saved cursor; staleness
    weights.py   published policy versions: atomic, immutable, newest-first lookup
    flow.py      flow control and health: the learner's progress, the workers' heartbeats
    inspect.py   `python -m espo_jax.buffer inspect DIR`: what a buffer directory holds

Neither side's code is imported here, nor JAX: a rollout worker or a tool that reads a buffer
starts fast, and both sides import this package.
"""

from espo_jax.buffer.reader import BufferReader
from espo_jax.buffer.records import RecordDecodeError, Response, RolloutGroup
from espo_jax.buffer.shards import ShardInfo, list_shards, list_tmp_files
from espo_jax.buffer.writer import BufferWriter

__all__ = ["BufferReader", "BufferWriter", "RecordDecodeError", "Response", "RolloutGroup",
           "ShardInfo", "list_shards", "list_tmp_files"]
