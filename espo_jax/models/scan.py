"""Scanned layers: each run of repeating layers is one `nn.scan`, compiled once.

The decoder's layers are a Python loop by default, so the compiled program holds every layer and
its compile time and the compiler's memory grow with depth (Qwen3-30B-A3B's 48 layers looped took
566.9 s and 23.09 GiB of host memory to compile for a TPU, scanned 187.7 s and 9.77 GiB;
experiments/results/aot_qwen3_30b_a3b.json). `ModelConfig.scan_layers` scans them instead:
the layers are cut into runs whose layer kinds (dense or MoE, softmax or linear attention)
repeat one cycle, and a run's cycle is the body of a scan over its repeats. DeepSeek-V3 (3 dense
layers, then 58 MoE) is two runs of period 1; Qwen3.5-35B-A3B (three linear-attention layers,
then one full, ten times) one run of period 4; a layer that repeats nothing stays a plain layer.

The scan is also the parameter layout. Per layer (`scan_layers=False`): `layers_{i}` for every
layer, the layout of Hugging Face checkpoints, of the engine's weights and caches and of FP8
quantisation. Scanned: a run is one entry `scan_{start}_{stop}` holding its cycle's blocks
`layer_{q}`, every weight with a leading axis of the run's repeats (logical axis "layers", never
split over the mesh). The learner holds the scanned layout when its config asks for it (no copy
of the weights per step); `stack` converts per-layer weights into it, and `unstack` gives them
back to every reader of weights by layer (the engine, the Hugging Face export).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax.models.config import ModelConfig

MAX_PERIOD = 8  # the longest layer cycle looked for (Qwen3.5's is 4)
PREFIX = "scan_"


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers start, start + 1, ..., stop - 1: `period` layer kinds repeated `repeats` times."""

    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    @property
    def name(self) -> str:
        """The run's parameter entry: `layers_{i}` for one layer, else `scan_{start}_{stop}`."""
        return f"layers_{self.start}" if self.repeats == 1 else f"{PREFIX}{self.start}_{self.stop}"

    def layer(self, q: int, j: int) -> int:
        """The layer at position q of the cycle in repeat j."""
        return self.start + j * self.period + q


def layer_kind(config: ModelConfig, i: int) -> tuple[bool, str]:
    return config.is_moe_layer(i), config.layer_type(i)


def runs(config: ModelConfig) -> tuple[Run, ...]:
    """The model's layers as runs, front to back: at each layer the cycle (of at most MAX_PERIOD
    kinds) that repeats over the most layers, the shortest cycle among equals; `scan_layers`
    off, one run per layer."""
    n = config.n_layers
    if not config.scan_layers:
        return tuple(Run(i, 1, 1) for i in range(n))
    kinds = [layer_kind(config, i) for i in range(n)]
    out, i = [], 0
    while i < n:
        best = Run(i, 1, 1)
        for p in range(1, min(MAX_PERIOD, (n - i) // 2) + 1):
            r = 1
            while i + (r + 1) * p <= n and kinds[i + r * p:i + (r + 1) * p] == kinds[i:i + p]:
                r += 1
            if r > 1 and p * r > best.period * best.repeats:
                best = Run(i, p, r)
        out.append(best)
        i = best.stop
    return tuple(out)


def is_scanned(params: dict) -> bool:
    return any(k.startswith(PREFIX) for k in params)


def _stack(leaves: list) -> Any:
    if all(isinstance(x, np.ndarray) for x in leaves):
        return np.stack(leaves)
    return jnp.stack(leaves)


def stack(config: ModelConfig, params: dict) -> dict:
    """Per-layer parameters (`layers_{i}`) in the layout of `config`: unchanged unless
    `config.scan_layers`. Host (numpy) arrays stay on the host."""
    if not config.scan_layers or is_scanned(params):
        return params
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    for run in runs(config):
        if run.repeats == 1:
            out[run.name] = params[run.name]
            continue
        out[run.name] = {
            f"layer_{q}": jax.tree.map(
                lambda *xs: _stack(list(xs)),
                *[params[f"layers_{run.layer(q, j)}"] for j in range(run.repeats)])
            for q in range(run.period)}
    return out


def unstack(params: dict) -> dict:
    """Per-layer parameters (`layers_{i}`) of either layout (the scanned one read from its own
    entries: `scan_{start}_{stop}` with `layer_{q}` blocks of a leading repeats axis)."""
    if not is_scanned(params):
        return params
    out = {k: v for k, v in params.items() if not k.startswith(PREFIX)}
    for name, blocks in params.items():
        if not name.startswith(PREFIX):
            continue
        start, stop = (int(s) for s in name[len(PREFIX):].split("_"))
        period = len(blocks)
        for q in range(period):
            for j in range((stop - start) // period):
                out[f"layers_{start + j * period + q}"] = jax.tree.map(
                    lambda x, j=j: x[j], blocks[f"layer_{q}"])
    return out


def locate(config: ModelConfig, i: int) -> tuple[tuple[str, ...], int | None]:
    """Where layer i's weights lie in the layout of `config`: the path of its block and, in a
    scanned run, its index on the leading axis (None for a plain layer)."""
    for run in runs(config):
        if run.start <= i < run.stop:
            if run.repeats == 1:
                return (run.name,), None
            j, q = divmod(i - run.start, run.period)
            return (run.name, f"layer_{q}"), j
    raise ValueError(f"layer {i} is not in 0..{config.n_layers - 1}")


__all__ = ["Run", "is_scanned", "locate", "runs", "stack", "unstack"]
