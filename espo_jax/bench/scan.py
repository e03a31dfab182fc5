"""Compile time against depth: the learner's gradient program with layers looped and scanned.

The `tiny` Qwen3-MoE preset's widths as the scale configs run them (grouped-matmul dispatch,
each block rematerialised), at 2 and at 48 layers (the depth of Qwen3-30B-A3B; `--quick`: 8),
in the per-layer layout (a Python loop: the program holds every layer) and with
`model.scan_layers` (each run of repeating layers one `nn.scan`: the program holds one layer).
Each program is `jax.value_and_grad` of the mean next-token cross-entropy plus the MoE aux loss
on 4 rows of 64 tokens, lowered and compiled by XLA:CPU with the persistent compilation cache
off; the figures are the median wall seconds of `repeats` compiles of each and the size of the
optimised program (HLO instructions). The scan changes no output (tests/models/test_scan.py).

    python -m espo_jax.bench scan [--quick] [--out FILE.json]
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import optax

from espo_jax.bench import cpu_model, format_table
from espo_jax.models import forward, get_preset, init_params

ROWS, LENGTH = 4, 64


def _loss(config, params, tokens_BxT):
    out = forward(config, params, tokens_BxT[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, tokens_BxT[:, 1:])
    return jnp.mean(ce) + out.aux_loss


def compile_figures(config, repeats: int) -> dict:
    """Median compile seconds of the gradient program of `config` and its HLO size."""
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((ROWS, LENGTH + 1), jnp.int32)
    seconds, compiled = [], None
    for _ in range(repeats):  # lowered anew each time: a lowering keeps its compiled program
        fn = jax.jit(jax.value_and_grad(lambda p, t: _loss(config, p, t)))
        lowered = fn.lower(params, tokens)
        start = time.perf_counter()
        compiled = lowered.compile()
        seconds.append(time.perf_counter() - start)
    text = compiled.as_text()
    return {"compile_s": statistics.median(seconds), "compile_s_each": seconds,
            "hlo_instructions": sum(1 for line in text.splitlines() if " = " in line)}


def run(quick: bool = False) -> dict:
    jax.config.update("jax_enable_compilation_cache", False)  # every compile a cold one
    depths = (2, 8) if quick else (2, 48)
    repeats = 1 if quick else 3
    base = get_preset("tiny", dispatch="ragged", remat=True)
    name, units = cpu_model()
    figures: dict = {"cpu_model": name, "cpu_flags": units, "date": time.strftime("%Y-%m-%d"),
                     "preset": "tiny", "dispatch": "ragged", "remat": True, "rows": ROWS,
                     "length": LENGTH, "repeats": repeats, "depths": list(depths),
                     "layouts": {}}
    rows = []
    for layout, scanned in (("loop", False), ("scan", True)):
        per_depth = {}
        for n in depths:
            per_depth[str(n)] = f = compile_figures(
                base.replace(n_layers=n, scan_layers=scanned), repeats)
            rows.append([layout, n, f["compile_s"], f["hlo_instructions"]])
            print(f"{layout} {n} layers: {f['compile_s']:.2f} s, {f['hlo_instructions']} "
                  "HLO instructions", flush=True)
        figures["layouts"][layout] = per_depth
    lo, hi = (str(n) for n in depths)
    for layout in ("loop", "scan"):
        d = figures["layouts"][layout]
        figures["layouts"][layout]["growth"] = d[hi]["compile_s"] / d[lo]["compile_s"]
    figures["scan_vs_loop_at_depth"] = (figures["layouts"]["loop"][hi]["compile_s"]
                                        / figures["layouts"]["scan"][hi]["compile_s"])
    print(format_table(["layout", "layers", "compile s (median)", "HLO instructions"], rows))
    print(f"compile time {lo} -> {hi} layers: loop x{figures['layouts']['loop']['growth']:.2f}, "
          f"scan x{figures['layouts']['scan']['growth']:.2f}; at {hi} layers the loop compiles "
          f"{figures['scan_vs_loop_at_depth']:.2f}x as long as the scan")
    return figures
