"""espo_jax.rollout: generation side of the pipeline.

records (RolloutGroup/Response, encode/decode), buffer (BufferWriter/BufferReader over ArrayRecord
shards), shards (shard file names and listing); engines, workers and scheduling alongside.
Import the submodule you need: this package imports nothing (worker processes start fast).
"""
