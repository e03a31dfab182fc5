"""`python -m espo_jax.bench aot --config EXPERIMENT --topology TOPOLOGY [--out F]`: the
experiment's learner update compiled for a TPU slice on this (CPU) host, and whether it fits.

The TPU compiler runs without a TPU (`pip install -e '.[tpu]'`: libtpu, as MaxText's
`train_compile.py` uses it): `jax.experimental.topologies` gives the slice's abstract devices,
the learner is built on a mesh over them from abstract arrays (nothing is allocated), and the
update the experiment runs (its rows per update at its full length, unpacked or packed as it
says, router replay, its loss, its micro-batches with float32 accumulation, AdamW on float32
master weights, the state donated) is lowered and compiled by XLA:TPU. Its `memory_analysis()`
is the TPU compiler's own buffer assignment: the per-chip bytes of the arguments (state and
batch), outputs, temporaries and aliases (donated buffers reused), and `peak_bytes` = arguments
+ outputs + temporaries - aliases, against the chip's HBM. The whole model, every layer.

TOPOLOGY: `v5p:2x2x4` (chips per dimension) or `v5p-32` (Cloud TPU names: TensorCores for v5p
and v4, chips for v5e and v6e). EXPERIMENT: a path with its `:args`, e.g.
`experiments/qwen3_30b_a3b.py:devices=16,expert=8`; its mesh must have as many devices as the
slice has chips.
"""

from __future__ import annotations

import functools
import math
import os
import re
import resource
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from espo_jax import config_validation, configs, mesh_rules, run_record, sharding
from espo_jax.bench import cpu_model
from espo_jax.cli_errors import CommandLineError
from espo_jax.models.flops import param_count
from espo_jax.run_setup import MASTER_DTYPE, preset_model_config

GIB = 1 << 30
# HBM per chip, bytes (Cloud TPU documentation)
HBM = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}
CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}  # in the `v5p-N` names
_COLLECTIVES = ("ragged-all-to-all", "all-to-all", "all-gather", "all-reduce", "reduce-scatter",
                "collective-permute")


def parse_topology(name: str) -> tuple[str, str, int]:
    """(generation, `gen:AxBxC` topology name, chips) of `v5p:2x2x4` or `v5p-32`."""
    if m := re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)", name):
        gen, dims = m.group(1), [int(d) for d in m.group(2).split("x")]
        return gen, name, math.prod(dims)
    if m := re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", name):
        gen, n = m.group(1), int(m.group(2))
        chips = n // CORES_PER_CHIP[gen]
        if chips < 1 or chips & (chips - 1):
            raise CommandLineError(f"--topology {name}: {n} is not a power-of-two slice")
        dims = [1, 1, 1] if gen in ("v4", "v5p") else [1, 1]
        while math.prod(dims) < chips:  # grow the smallest dimension: 2x2x4, 2x4x4, 4x4x4...
            dims[dims.index(min(dims))] *= 2
        return gen, f"{gen}:{'x'.join(map(str, sorted(dims)))}", chips
    raise CommandLineError(f"--topology {name!r}: give e.g. v5p:2x2x4 or v5p-32 (generations "
                           f"{', '.join(HBM)})")


def load_experiment(spec: str):
    """`path/to/experiment.py[:args]`'s config."""
    path, _, arg = spec.partition(".py")
    path += ".py"
    if not os.path.isfile(path) or (arg and not arg.startswith(":")):
        raise CommandLineError(f"--config {spec!r}: give an experiment file, e.g. "
                               "experiments/qwen3_30b_a3b.py:devices=16,expert=8")
    return configs.import_file(path).get_config(arg[1:] or None)


def state_bytes(config, mesh, rules=mesh_rules.DEFAULT_RULES,
                moment_dtype: str = "float32") -> dict[str, int]:
    """Per-device bytes of the float32 master parameters and of the AdamW state
    (`train.state.make_optimizer`, its two moments in `moment_dtype`, `optim.moment_dtype`) on
    `mesh` (a Mesh or AbstractMesh); exact, from abstract arrays."""
    from espo_jax.models.transformer import init_boxed
    from espo_jax.train.state import make_optimizer

    boxed = jax.eval_shape(functools.partial(
        init_boxed, config.replace(param_dtype=MASTER_DTYPE)), jax.random.key(0))
    shapes = nn.meta.unbox(boxed)
    shards = jax.tree.leaves(sharding.logical_to_mesh_shardings(
        nn.get_partition_spec(boxed), mesh, rules),
        is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    params = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                 for x, s in zip(jax.tree.leaves(shapes), shards, strict=True))
    optim = configs.default_config().optim
    optim.moment_dtype = moment_dtype
    opt = jax.eval_shape(make_optimizer(optim, 10).init, shapes)
    moments = [x for x in jax.tree.leaves(opt) if x.ndim]
    # AdamW keeps mu and nu: two copies of every parameter, sharded as the parameter
    if [(x.shape, x.dtype) for x in moments] != [(x.shape, jnp.dtype(moment_dtype))
                                                 for x in jax.tree.leaves(shapes)] * 2:
        raise ValueError("the optimizer state is not two parameter-shaped moments")
    scalars = sum(x.dtype.itemsize for x in jax.tree.leaves(opt) if not x.ndim)
    narrow = jnp.dtype(moment_dtype).itemsize / jnp.dtype(MASTER_DTYPE).itemsize
    return {"params": params, "optimizer": int(2 * params * narrow) + scalars}


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def collectives(hlo: str) -> dict[str, int]:
    """Each collective op of a compiled HLO text and how many instructions run it."""
    found = re.findall(r"\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", hlo)
    return {op: found.count(op) for op in _COLLECTIVES if op in found}


def _mesh(config, devices) -> jax.sharding.Mesh:
    """The experiment's mesh over the slice's abstract devices."""
    shape = mesh_rules.mesh_shape(config.mesh, len(devices))
    return jax.sharding.Mesh(np.array(devices).reshape(shape), mesh_rules.MESH_AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * 4)


def compile_learner(config, devices) -> tuple[dict, object]:
    """The experiment's update compiled for `devices`: the figures `run` stores."""
    from espo_jax.models import init_params
    from espo_jax.train import state as state_lib
    from espo_jax.train.learner import Learner

    model_config = preset_model_config(config)
    mesh = _mesh(config, devices)
    rules = mesh_rules.rules_from_config(config.mesh)
    param_shardings = sharding.param_shardings(model_config, mesh, rules)
    params = _abstract(jax.eval_shape(functools.partial(init_params, model_config),
                                      jax.random.key(0)), param_shardings)
    tx = state_lib.make_optimizer(config.optim, config.train.steps * config.train.updates_per_batch)
    shapes = jax.eval_shape(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)),
                            params)
    # the moments sharded as their parameters, the counts (and the rng) replicated
    replicated = sharding.replicated(mesh)
    state_shardings = shapes.replace(
        params=param_shardings, step=replicated, skipped=replicated, rng=replicated,
        opt_state=optax.tree_map_params(tx, lambda _, s: s, shapes.opt_state, param_shardings,
                                        transform_non_params=lambda _: replicated))
    state = _abstract(shapes, state_shardings)
    learner = Learner(config, model_config, mesh, state_shardings)
    example = learner._example_batch()
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=learner.batch_sharding),
        example)
    rows = jax.ShapeDtypeStruct(example.loss_mask.shape, jnp.float32,
                                sharding=learner.batch_sharding)
    batch = batch.replace(old_logp=rows, old_entropy=rows)  # after the old-policy pass
    start = time.time()
    tokens = math.prod(example.tokens.shape)
    shape = dict(rows=int(example.tokens.shape[0]), row_tokens=int(example.tokens.shape[1]),
                 micro_batches=int(config.train.micro_batches))
    with sharding.activation_sharding(mesh, rules):
        lowered = learner._train_step.lower(state, batch, None)
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a program over HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return _refused(str(e), time.time() - start, shape), model_config
    out = _figures(compiled, time.time() - start, tokens, len(devices))
    out.update(shape)
    return out, model_config


def _split_first(tree, mesh):
    """Each array split over all of `mesh`'s devices along its first axis they divide
    (replicated when none does)."""
    n = mesh.devices.size

    def one(x):
        for axis, size in enumerate(x.shape):
            if size % n == 0:
                spec = [None] * len(x.shape)
                spec[axis] = tuple(mesh.axis_names)
                return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    return jax.tree.map(one, tree)


def compile_engine(config, devices) -> dict:
    """The embedded engine's decode call (`rollout.steps_per_sync` steps over
    `rollout.num_slots` slots, a cache of `max_prompt_len + max_new_tokens` positions, weights
    at `rollout.precision`) compiled for `devices`: every weight and cache array split over
    the chips along its first axis they divide, the rest placed by XLA's partitioner."""
    from espo_jax.models import init_params
    from espo_jax.rollout import decode

    model_config = preset_model_config(config)
    r = config.rollout
    slots, context = int(r.num_slots), int(r.max_prompt_len + r.max_new_tokens)
    mesh = _mesh(config, devices)
    engine_config = decode.engine_params({}, model_config, r.precision)[1]
    params = jax.eval_shape(
        lambda key: decode.engine_params(init_params(model_config, key), model_config,
                                         r.precision)[0], jax.random.key(0))
    state = jax.eval_shape(functools.partial(decode._init_state, engine_config, slots, context,
                                             8))
    params, state = (_abstract(t, _split_first(t, mesh)) for t in (params, state))
    steps = int(r.steps_per_sync)
    start = time.time()
    lowered = decode.generate_jit.lower(engine_config, steps, params, state)
    shape = dict(slots=slots, context=context, steps=steps, precision=r.precision)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return _refused(str(e), time.time() - start, shape)
    out = _figures(compiled, time.time() - start, tokens=slots * steps, n_devices=len(devices))
    out.update(shape)
    return out


def _figures(compiled, compile_s: float, tokens: int, n_devices: int) -> dict:
    """A compiled program's per-chip memory (XLA's buffer assignment), FLOPs per token and
    collectives."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out = {f"{k}_bytes": int(getattr(mem, f"{k}_size_in_bytes"))
           for k in ("argument", "output", "temp", "alias")}
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                         - out["alias_bytes"])
    out.update(compile_s=round(compile_s, 1),
               flops_per_token=float(cost.get("flops", 0.0)) * n_devices / tokens,
               collectives=collectives(compiled.as_text()))
    return out


def _refused(message: str, seconds: float, shape: dict) -> dict:
    """The figures of a program XLA:TPU refused for HBM: the temporaries it needed (its
    message: "the total memory required for HLO temporaries (246.73G) exceeds ...")."""
    m = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", message)
    temp = None if m is None else int(float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024)
    return {"refused": message.splitlines()[0][:400], "temp_bytes": temp, "peak_bytes": None,
            "compile_s": round(seconds, 1), **shape}


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run(quick: bool = False, config: str | None = None, topology: str | None = None) -> dict:
    if not config or not topology:
        raise CommandLineError("bench aot needs --config EXPERIMENT and --topology TOPOLOGY")
    gen, name, chips = parse_topology(topology)
    commit = run_record.git_commit()  # the code compiled, not the checkout's after (minutes)
    experiment = load_experiment(config)
    n_mesh = math.prod(mesh_rules.mesh_shape(experiment.mesh, chips))
    config_validation.validate(experiment, n_devices=n_mesh, check_paths=False)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # beside other JAX processes
    try:
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    except Exception as e:  # noqa: BLE001 (libtpu absent or refusing the name)
        raise CommandLineError(f"cannot build TPU topology {name}: {e} (the TPU compiler comes "
                               "with pip install -e '.[tpu]')") from None
    learner, model_config = compile_learner(experiment, devices)
    engine = compile_engine(experiment, devices)
    hbm = HBM[gen]
    for part in (learner, engine):
        part["fits"] = part["peak_bytes"] is not None and part["peak_bytes"] <= 0.9 * hbm
    figures = {
        "topology": name, "chips": chips, "hbm_bytes": hbm, "config": config,
        "date": time.strftime("%Y-%m-%d"), "commit": commit,
        "libtpu": _version("libtpu"),
        "n_layers": model_config.n_layers, "layers_compiled": model_config.n_layers,
        "params": param_count(model_config), "master_dtype": MASTER_DTYPE,
        "moment_dtype": experiment.optim.moment_dtype, "learner": learner, "engine": engine,
    }
    cpu, units = cpu_model()
    figures.update(  # the compiling host: its CPU and the compiler's memory (peak RSS)
        host_cpu=f"{cpu} ({'AVX-512' if 'avx512f' in units else 'no AVX-512'}), "
                 f"{os.cpu_count()} cores",
        host_peak_rss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    print(f"{config} on {name} ({chips} chips, {hbm / GIB:.0f} GiB HBM each), "
          f"{model_config.n_layers} layers")
    for label, part in (("learner", learner), ("engine", engine)):
        print(f"  {label}: compiled in {part['compile_s']} s")
        if part["peak_bytes"] is None:
            print(f"  {label} does not fit: {part['refused']}")
            continue
        for key in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                    "peak_bytes"):
            print(f"  {label} {key:15s} {part[key] / GIB:9.2f} GiB")
        print(f"  {label} peak: {part['peak_bytes'] / hbm:.1%} of HBM "
              f"({'fits' if part['fits'] else 'does not fit'} at 90%); "
              f"collectives {part['collectives']}")
    return figures
