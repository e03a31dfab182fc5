"""Device meshes and parameter sharding from logical axis names (MaxText style).

The model names the axes of every weight logically ("embed", "heads", "kv_heads", "mlp",
"vocab", "exp", MLA's "q_lora" and "kv_lora", "norm") and of activations ("batch", "length",
"embed"); the run's `config.mesh.rules` (default `DEFAULT_RULES`, read with `rules_from_config`)
maps those names to the four mesh axes `data`, `fsdp`, `expert`, `tensor`. Expert weights
[E, ...] are split on `expert` (DeepSeek-V3's 256 experts: 32 per device at expert=8); the batch
on `data` x `fsdp` x `expert` (`batch_shards`), the MoE layers then expert parallel
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

from espo_jax.models.config import ModelConfig
from espo_jax.models.transformer import init_boxed

MESH_AXES = ("data", "fsdp", "expert", "tensor")
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Logical name -> mesh axes. Each mesh axis is used at most once per array (Flax skips a rule
# whose mesh axis is already taken by an earlier dimension of the same array).
DEFAULT_RULES: Rules = (
    # activations and inputs: every axis that holds no weight dimension of the attention and
    # dense layers, `expert` included (each device of an expert group its own tokens; left
    # out, the group repeats the attention: 2.6x the step in MaxText, maxtext#4005)
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("exp", "expert"),  # expert weights [E, ...]: expert parallel
    # weights' model dimension: fully sharded over every device of the batch that is not
    # already holding a different expert, so the dense weights (attention, embeddings, shared
    # experts) are not repeated on the devices of an expert group; an expert weight, whose E
    # took `expert`, gets the second rule (fsdp only). The first rule that is free applies.
    ("embed", ("fsdp", "expert")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    # MLA's low-rank dims (q_lora_rank, kv_lora_rank): the up-projections q_b / kv_b
    # [rank, heads] take fsdp here (their heads take tensor); the down-projections q_a / kv_a
    # [embed, rank] already have fsdp on embed, so these rules give way there (MaxText's choice)
    ("q_lora", "fsdp"),
    ("kv_lora", "fsdp"),
    ("norm", None),
    ("layers", None),  # the repeats axis of a scanned run (`models.scan`): never split
)


LOGICAL_AXES = ("batch", "length", "exp", "embed", "vocab", "heads", "kv_heads", "mlp", "q_lora",
                "kv_lora", "norm", "layers")


def rules_from_config(mesh_config: Any) -> Rules:
    """`mesh_config.rules` as `Rules` (tuples, whatever sequence type the config holds),
    checked: every logical name known, every mesh axis one of MESH_AXES (or None)."""
    rules, errors = [], []
    for entry in mesh_config.rules:
        if isinstance(entry, str) or len(entry) != 2:
            errors.append(f"{entry!r} is not a (logical name, mesh axes) pair")
            continue
        name, axes = entry
        if isinstance(axes, (list, tuple)):
            axes = tuple(axes)
        for axis in (axes,) if axes is None or isinstance(axes, str) else axes:
            if axis is not None and axis not in MESH_AXES:
                errors.append(f"{name!r} -> {axis!r}: mesh axes are {MESH_AXES}")
        if name not in LOGICAL_AXES:
            errors.append(f"unknown logical axis {name!r}; the model names {LOGICAL_AXES}")
        rules.append((name, axes))
    if errors:
        raise ValueError("config.mesh.rules: " + "; ".join(errors))
    return tuple(rules)


def batch_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes the `batch` rule splits the batch over."""
    axes = dict(rules).get("batch")
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def batch_shards(mesh_config: Any) -> int:
    """How many shards a batch's rows are split into: the product of the sizes of the mesh axes
    of `mesh_config.rules`' `batch` rule (data x fsdp x expert by default)."""
    sizes = _axis_sizes(mesh_config)
    return math.prod(sizes[a] for a in batch_axes(rules_from_config(mesh_config)))


def _axis_sizes(mesh_config: Any) -> dict[str, int]:
    try:
        return {a: int(getattr(mesh_config, a)) for a in MESH_AXES}
    except AttributeError as e:
        raise ValueError(f"mesh config needs the fields {MESH_AXES}: {e}") from None


def mesh_shape(mesh_config: Any, n_devices: int) -> tuple[int, ...]:
    """The (data, fsdp, expert, tensor) sizes for `n_devices`, resolving one -1."""
    sizes = _axis_sizes(mesh_config)
    free = [a for a, s in sizes.items() if s == -1]
    bad = [f"{a}={s}" for a, s in sizes.items() if s == 0 or s < -1]
    if bad or len(free) > 1:
        raise ValueError(f"mesh axis sizes must be >= 1 (one may be -1), got {sizes}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n_devices % fixed:
            raise ValueError(f"{n_devices} devices are not divisible by the fixed mesh axes "
                             f"{sizes} (product {fixed})")
        sizes[free[0]] = n_devices // fixed
    product = math.prod(sizes.values())
    if product != n_devices:
        expr = "*".join(str(sizes[a]) for a in MESH_AXES)
        raise ValueError(f"mesh {'*'.join(MESH_AXES)} = {expr} = {product} != {n_devices} "
                         "devices")
    return tuple(sizes[a] for a in MESH_AXES)


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
    "DEFAULT_RULES", "LOGICAL_AXES", "MESH_AXES", "activation_sharding", "batch_sharding",
    "batch_axes", "batch_shards", "init_sharded", "logical_specs", "logical_to_mesh_shardings",
    "make_mesh", "mesh_shape",
    "param_shardings", "replicated", "rules_from_config", "validate_divisibility",
]
