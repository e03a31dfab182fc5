"""The mesh's names and rules, in plain Python: the four mesh axes, the logical axis names the
model gives its weights and activations, the default rules between them, a run's
`config.mesh.rules` read and checked, and what follows from them without a device (the mesh's
shape for a device count, the mesh axes and the number of shards of a batch's rows).

One definition that config validation, the model's expert-parallel layer (`models.moe_ep`), the
learner and the benchmarks read; no JAX here, so validating a config imports none
(`espo_jax.sharding` builds meshes and shardings from these).
"""

from __future__ import annotations

import math
from typing import Any

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
    """The mesh axes the `batch` rule splits the batch over (the first `batch` rule, as Flax
    reads the rules). The model's expert-parallel layer passes the rules it is traced under
    (`flax.linen.get_logical_axis_rules()`), validation and the learner the run's."""
    axes = next((axes for name, axes in rules if name == "batch"), None)
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
