"""ESPO vs GRPO vs DAPO vs GSPO on `arith_chains`, and the same wall time spent on the warm start.

    python launch/arith_compare.py --workdir /tmp/arith_compare [--jobs=2] [--small]

1. `experiments/arith_espo.py` (the README's first command) runs in WORKDIR/espo: warm start,
   then ESPO with every zero-variance stage. Its warm-started policy is WORKDIR/espo/warmstart.
2. `arith_grpo.py`, `arith_dapo.py`, `arith_gspo.py` start from that same policy
   (`checkpoint.init_from`) with the same RL budget (steps, prompts, samples): the experiments
   differ by the loss only.
3. `sft_only`: the default experiment with no RL, whose warm start instead gets the wall time
   ESPO spent on warm start + RL (`warmstart.max_seconds`), with its step count and cosine
   schedule stretched to that time at ESPO's measured warm-start speed.

Every run is a real main job (a subprocess, its log in WORKDIR/NAME.log). Finished runs
(WORKDIR/NAME/summary.json present) are not run again, so the script can be resumed. It writes
WORKDIR/comparison.json, WORKDIR/comparison.md (the README's table) and
WORKDIR/comparison.png (held-out accuracy per level). With `--jobs 2` steps 2-3 run two at a
time: faster, but each run then shares the CPU and its wall time says so. `--override=x.y=v`
(repeatable) adds `--config.x.y=v` to every run.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import sys

from absl import app, flags

from espo_jax.zve import accounting

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import main_jobs  # noqa: E402  (launch/main_jobs.py, beside this script)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINES = ("grpo", "dapo", "gspo")
ROWS = ("espo", *BASELINES, "sft_only")
_WORKDIR = flags.DEFINE_string("workdir", None, "one subdirectory per run, and the comparison")
_JOBS = flags.DEFINE_integer("jobs", 1, "runs at a time after the ESPO run", lower_bound=1)
_SMALL = flags.DEFINE_bool(
    "small", False, "the experiments' small variants (tiny model, 2 RL steps): a smoke test")
_OVERRIDE = flags.DEFINE_multi_string(
    "override", [], "x.y=v: --config.x.y=v for every run (e.g. train.steps=40); repeatable")
flags.mark_flag_as_required("workdir")


def run_main(workdir: str, name: str, experiment: str, overrides: list[str],
             small: bool = False) -> dict:
    """One main job in WORKDIR/NAME (skipped when its summary exists); returns its summary."""
    return main_jobs.run_main(os.path.join(workdir, name), experiment, overrides, label=name,
                              log_path=os.path.join(workdir, f"{name}.log"), small=small)


def sft_flags(espo: dict) -> list[str]:
    """The warm start alone, for as long as ESPO's warm start + RL took."""
    budget = espo["warmstart_seconds"] + espo["rl_seconds"]
    per_step = espo["warmstart_seconds"] / max(espo["warmstart_steps"], 1)
    steps = math.ceil(budget / per_step)
    return ["--config.train.steps=0", f"--config.warmstart.steps={steps}",
            "--config.warmstart.target_accuracy=2.0",  # never stop early on accuracy
            f"--config.warmstart.max_seconds={budget:.0f}",
            f"--config.warmstart.eval_every={max(steps // 6, 1)}"]


def levels(summary: dict, key: str) -> dict[int, float]:
    prefix = "eval/accuracy_level"
    return {int(k[len(prefix):]): v for k, v in summary[key].items() if k.startswith(prefix)}


def table(summaries: dict[str, dict]) -> str:
    """Markdown: one row per run, held-out accuracy overall and per level, costs."""
    level_ids = sorted(levels(summaries["espo"], "final"))
    head = (["run", "final acc", "vs warm start"] + [f"L{lv}" for lv in level_ids]
            + ["no-signal token frac with offline", "mean abs dlogp", "RL s", "warm-start s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    warm = summaries["espo"]["warmstart_accuracy"]
    start = levels(summaries["espo"], "warmstart")
    lines.append("| warm start (shared) | " + " | ".join(
        [f"{warm:.3f}", "-"] + [f"{start[lv]:.2f}" for lv in level_ids]
        + ["-", "-", "-", f"{summaries['espo']['warmstart_seconds']:.0f}"]) + " |")
    for name, s in summaries.items():
        per = levels(s, "final")
        rl = name != "sft_only"
        lines.append(f"| {name} | " + " | ".join(
            [f"{s['final_accuracy']:.3f}", f"{100 * (s['final_accuracy'] - warm):+.1f} pts"]
            + [f"{per[lv]:.2f}" for lv in level_ids]
            + [f"{accounting.current_names(s)['no_signal_token_frac_with_offline']:.3f}"
               if rl else "-",
               f"{s['mean_abs_logp_mismatch']:.4f}" if rl else "-",
               f"{s['rl_seconds']:.0f}" if rl else "-",
               f"{s['warmstart_seconds']:.0f}" if name in ("espo", "sft_only") else "shared"])
            + " |")
    return "\n".join(lines)


def plot(summaries: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    level_ids = sorted(levels(summaries["espo"], "final"))
    bars = {"warm start": levels(summaries["espo"], "warmstart"),
            **{name: levels(s, "final") for name, s in summaries.items()}}
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(9, 4.4))
    x = np.arange(len(level_ids))
    for i, (name, per) in enumerate(bars.items()):
        ax.bar(x + i * width, [per[lv] for lv in level_ids], width, label=name)
    ax.set_xticks(x + 0.4 - width / 2, [f"level {lv}" for lv in level_ids])
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8, ncol=len(bars), loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.set_title("arith_chains: one warm start, then each loss (same RL budget)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    workdir = os.path.abspath(_WORKDIR.value)
    os.makedirs(workdir, exist_ok=True)
    extra = [f"--config.{o}" for o in _OVERRIDE.value]
    espo = run_main(workdir, "espo", "arith_espo", extra, _SMALL.value)
    init = [f"--config.checkpoint.init_from={os.path.join(workdir, 'espo', 'warmstart')}"]
    jobs = {name: (f"arith_{name}", extra + init) for name in BASELINES}
    jobs["sft_only"] = ("arith_espo", extra + sft_flags(espo))
    with concurrent.futures.ThreadPoolExecutor(max_workers=_JOBS.value) as pool:
        futures = {name: pool.submit(run_main, workdir, name, exp, run_flags, _SMALL.value)
                   for name, (exp, run_flags) in jobs.items()}
        summaries = {"espo": espo, **{name: f.result() for name, f in futures.items()}}
    text = table(summaries)
    print(text)
    with open(os.path.join(workdir, "comparison.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(workdir, "comparison.json"), "w") as f:
        json.dump({"jobs": _JOBS.value, "flags": extra, "runs": summaries}, f, indent=2)
    plot(summaries, os.path.join(workdir, "comparison.png"))
    print(f"written: {workdir}/comparison.md, comparison.json, comparison.png")
    return 0


if __name__ == "__main__":
    app.run(main)
