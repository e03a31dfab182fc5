"""Device meshes and parameter sharding from logical axis names (MaxText style).

The model names the axes of every weight logically ("embed", "heads", "kv_heads", "mlp",
"vocab", "exp", MLA's "q_lora" and "kv_lora", "norm") and of activations ("batch", "length",
"embed"); the run's `config.mesh.rules` (default `mesh_rules.DEFAULT_RULES`, read with
`mesh_rules.rules_from_config`)
maps those names to the four mesh axes `data`, `fsdp`, `expert`, `tensor`. Expert weights
[E, ...] are split on `expert` (DeepSeek-V3's 256 experts: 32 per device at expert=8); the batch
on `data` x `fsdp` x `expert` (`mesh_rules.batch_shards`), the MoE layers then expert parallel
(`moe_ep`). Shared experts (DeepSeek / GLM `n_shared_experts`, the Qwen2-MoE shared expert) are
dense SwiGLUs, ("embed", "mlp") and ("mlp", "embed") as every MLP. The learner
traces its steps under the same rules (`activation_sharding`), so the model's activation
constraints act in training.

Initialisation never materialises the whole model on one device: `jax.eval_shape` gives the
abstract parameters with their logical axes, the rules give `NamedSharding`s, and
`jax.jit(init, out_shardings=...)` creates each shard where it lives (`init_sharded`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from espo_jax.mesh_rules import DEFAULT_RULES, MESH_AXES, Rules, mesh_shape
from espo_jax.models.config import ModelConfig
from espo_jax.models.transformer import init_boxed


def make_mesh(mesh_config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, expert, tensor), all of type Auto (so that
    `with_sharding_constraint` and jit shardings work; `jax.make_mesh` defaults to Explicit)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_config, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4,
                         devices=devices)


def logical_specs(config: ModelConfig) -> Any:
    """Parameter tree of PartitionSpecs of logical axis names (no arrays are created)."""
    abstract = jax.eval_shape(functools.partial(init_boxed, config), jax.random.key(0))
    return nn.get_partition_spec(abstract)


def logical_to_mesh_shardings(specs: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """NamedShardings of a tree of logical PartitionSpecs under `rules`."""
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def validate_divisibility(config: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
    """Raise if a parameter dimension is not divisible by the mesh axes it is sharded over."""
    abstract = jax.eval_shape(functools.partial(init_boxed, config), jax.random.key(0))
    shapes = nn.meta.unbox(abstract)
    shardings = logical_to_mesh_shardings(nn.get_partition_spec(abstract), mesh, rules)
    errors = []
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_sh = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, leaf), sharding in zip(flat, flat_sh, strict=True):
        for dim, (size, axes) in enumerate(zip(leaf.shape, sharding.spec, strict=False)):
            if axes is None:
                continue
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            n = math.prod(mesh.shape[a] for a in axes)
            if size % n:
                name = "/".join(str(getattr(k, "key", k)) for k in path)
                errors.append(f"{name} dim {dim} (size {size}) is not divisible by mesh axes "
                              f"{axes} (size {n})")
    if errors:
        raise ValueError("parameters do not fit the mesh: " + "; ".join(errors))


def param_shardings(config: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """NamedSharding for every parameter (same tree as `init_params`), validated."""
    validate_divisibility(config, mesh, rules)
    return logical_to_mesh_shardings(logical_specs(config), mesh, rules)


def init_sharded(config: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES,
                 rng: jax.Array | None = None) -> dict:
    """`init_params`, each shard created on its device (eval_shape -> shardings -> jit)."""
    rng = jax.random.key(0) if rng is None else rng
    shardings = param_shardings(config, mesh, rules)
    init = jax.jit(lambda r: nn.meta.unbox(init_boxed(config, r)), out_shardings=shardings)
    return init(rng)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding of any [B, ...] input (a batch pytree's every leaf): its first axis over the
    mesh axes of the `batch` rule, the other axes replicated."""
    return NamedSharding(mesh, PartitionSpec(*nn.logical_to_mesh_axes(("batch",), rules)))


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Within this context the model's logical activation constraints (batch, length, embed)
    become sharding constraints on `mesh`; outside it they are no-ops. Enter it around the
    (first) call of a jitted function, where tracing happens, not inside the jitted code."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


__all__ = [
    "activation_sharding", "batch_sharding", "init_sharded", "logical_specs",
    "logical_to_mesh_shardings", "make_mesh", "param_shardings", "replicated",
    "validate_divisibility",
]
