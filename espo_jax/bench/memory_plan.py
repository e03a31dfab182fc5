"""Per-device memory of a real-scale model on its mesh, from abstract arrays (no weights).

- Parameters and AdamW state: exact, from `jax.eval_shape` of the parameters and of the
  optimizer's `init`, each leaf's shard shape under the run's sharding rules.
- Temporaries of the learner's gradient (`train.step.sequence_logprobs` with replayed routing,
  the vocabulary projection in chunks): XLA's buffer assignment (`memory_analysis`) of
  `jax.jit(grad).lower(...).compile()` on the mesh. Compiling every layer of a 61-layer model
  takes too long on a few CPU cores, so a slice is compiled twice (the first dense layer + 1 and
  + 2 MoE layers) and the whole model's figure is the 1-MoE slice plus the per-layer difference
  times the layers left (with layer remat every layer keeps only its input: the same increment
  for dense and MoE layers). A hybrid model's slices are a linear + a full-attention layer and
  two linear + a full one (`slices`).

    python -m espo_jax.bench.memory_plan deepseek_v3 256 32 8 16384   # preset devices fsdp expert T
"""

from __future__ import annotations

import functools
import json
import math
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding

from espo_jax import configs, sharding
from espo_jax.models import get_preset
from espo_jax.models.config import ModelConfig
from espo_jax.models.transformer import init_boxed
from espo_jax.run_setup import MASTER_DTYPE
from espo_jax.train.state import make_optimizer
from espo_jax.train.step import sequence_logprobs


def _abstract(config: ModelConfig):
    boxed = jax.eval_shape(functools.partial(init_boxed, config), jax.random.key(0))
    return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def state_bytes(config: ModelConfig, mesh, rules=sharding.DEFAULT_RULES) -> dict[str, int]:
    """Per-device bytes of the parameters and of the AdamW state (`train.state.make_optimizer`)
    on `mesh` (a Mesh or AbstractMesh), the parameters being the learner's float32 masters;
    exact."""
    shapes, specs = _abstract(config.replace(param_dtype=MASTER_DTYPE))
    shards = _leaves(sharding.logical_to_mesh_shardings(specs, mesh, rules))
    params = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                 for x, s in zip(jax.tree.leaves(shapes), shards, strict=True))
    opt = jax.eval_shape(make_optimizer(configs.default_config().optim, 10).init, shapes)
    moments = [x for x in jax.tree.leaves(opt) if x.ndim]
    # AdamW keeps mu and nu: two copies of every parameter, sharded as the parameter
    pairs = [(x.shape, x.dtype) for x in jax.tree.leaves(shapes)]
    if [(x.shape, x.dtype) for x in moments] != pairs * 2:
        raise ValueError("the optimizer state is not two parameter-shaped moments")
    scalars = sum(x.dtype.itemsize for x in jax.tree.leaves(opt) if not x.ndim)
    return {"params": params, "optimizer": 2 * params + scalars}


def _grad_temp_bytes(config: ModelConfig, mesh, rules, rows: int, seq_len: int,
                     chunk: int) -> int:
    shapes, specs = _abstract(config)
    shards = sharding.logical_to_mesh_shardings(specs, mesh, rules)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          shapes, shards)
    batch = sharding.batch_sharding(mesh, rules)
    tokens = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=batch)
    routed = jax.ShapeDtypeStruct((rows, seq_len, config.n_moe_layers, config.top_k),
                                  jnp.int32, sharding=batch)

    def loss(p, tokens_BxT, routed_BxTxMxk):
        positions = jnp.broadcast_to(jnp.arange(seq_len), tokens_BxT.shape)
        logp, _, out = sequence_logprobs(config, p, tokens_BxT, positions, tokens_BxT,
                                         routed_BxTxMxk, chunk)
        return -jnp.mean(logp) + out.aux_loss

    with sharding.activation_sharding(mesh, rules):
        compiled = jax.jit(jax.grad(loss), out_shardings=shards).lower(
            params, tokens, routed).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def slices(config: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
    """The two compiled slices: the first dense layer (if any) + 1 and + 2 MoE layers; for a
    hybrid model (Gated DeltaNet and full-attention layers) a linear + a full layer, and two
    linear + a full layer (the per-layer difference is then a linear layer's: with remat the
    same saved input as a full layer's)."""
    dense = min(config.first_k_dense, 1)
    if not config.linear_layers:
        return tuple(config.replace(n_layers=dense + m, first_k_dense=dense) for m in (1, 2))
    if len(config.linear_layers) == config.n_layers:
        raise ValueError("memory_plan slices a hybrid model: it needs a full_attention layer")
    return tuple(config.replace(
        n_layers=dense + m + 1, first_k_dense=dense,
        layer_types=("full_attention",) * dense + ("linear_attention",) * m + ("full_attention",))
        for m in (1, 2))


def temp_bytes(config: ModelConfig, mesh, rules=sharding.DEFAULT_RULES, *, seq_len: int,
               chunk: int = 512) -> dict[str, int]:
    """Per-device temporaries of one micro-batch's gradient (one `seq_len` row per batch
    shard), scaled from two compiled slices (module docstring)."""
    rows = math.prod(mesh.shape[a] for a in nn.logical_to_mesh_axes(("batch",), rules)[0] or ())
    one, two = slices(config)
    t1 = _grad_temp_bytes(one, mesh, rules, rows, seq_len, chunk)
    t2 = _grad_temp_bytes(two, mesh, rules, rows, seq_len, chunk)
    per_layer = t2 - t1
    return {"slice_1": t1, "slice_2": t2, "per_layer": per_layer,
            "model": t1 + (config.n_layers - one.n_layers) * per_layer}


def main(argv: list[str]) -> None:
    preset, devices, fsdp, expert, seq_len = argv[0], *map(int, argv[1:5])
    config = get_preset(preset, remat=True, attention_chunk=1024)
    mesh_config = ml_collections.ConfigDict(dict(data=1, fsdp=fsdp, expert=expert, tensor=1))
    mesh = sharding.make_mesh(mesh_config, jax.devices()[:devices])
    out = {"preset": preset, "devices": devices, "seq_len": seq_len,
           **state_bytes(config, mesh), **temp_bytes(config, mesh, seq_len=seq_len)}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
