"""Where arrays live: the shapes of an array's shards on this process's devices."""

import jax


def addressable_shard_shapes(x: jax.Array) -> list[tuple[int, ...]]:
    """Shapes of the shards of `x` on this process's devices (to check a split happened)."""
    return [tuple(s.data.shape) for s in x.addressable_shards]
