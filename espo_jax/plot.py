"""Learning curves of a run: `python -m espo_jax.plot WORKDIR [--out DIR]` writes PNGs to
WORKDIR/plots (or DIR). Several runs side by side: `python -m espo_jax.plot --compare
--out FILE.png LABEL=WORKDIR ...` draws one metric (`--metric`, default held-out accuracy) of
each run in one figure and stores the curves it drew in FILE.json.

Reads WORKDIR/metrics.jsonl (RL and held-out eval records; the warm start has its own step
axis and is left out). One figure per topic; a topic is drawn when any of its metrics was
logged: accuracy, per-level accuracy, reward, zero-variance fraction, train-inference mismatch,
entropy, clipping, ratio tails, ESPO's eps. A resumed run logs the steps after its last
checkpoint twice; the later record of a step wins. Reads the file without JAX, so the command
starts fast.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from espo_jax.zve import accounting

# Topic -> metric names; a name ending in "*" matches every metric with that prefix.
TOPICS = {
    "accuracy": ("eval/accuracy", "eval/pass_at_k", "rollout/accuracy"),
    "accuracy_by_level": ("eval/accuracy_level*",),
    "reward": ("rollout/reward_mean", "rollout/reward_max"),
    "zero_variance": (
        "zve/zero_variance_frac_before",
        "zve/zero_variance_frac_after_tiebreak",
        "zve/zero_variance_frac_after_filter",
        "zve/no_signal_token_frac",
    ),
    "mismatch": ("mismatch/logp_abs_mean", "mismatch/kl_k3", "moe/routing_flip_rate"),
    "entropy": ("entropy/mean",),
    "clipping": ("pg/clipfrac_low", "pg/clipfrac_high", "pg/dual_clip_frac"),
    # The importance ratio's tails: all 1 with one update per rollout batch.
    "ratio": ("is_ratio/p01", "is_ratio/p05", "is_ratio/p95", "is_ratio/p99", "tis/weight_p99"),
    "espo_eps": ("espo/eps_high", "espo/eps_low", "espo/eps_mean"),
}
PHASES = ("rl", "eval")
_OUT = flags.DEFINE_string("out", None, "output folder (default WORKDIR/plots); with --compare "
                           "the PNG file")
_COMPARE = flags.DEFINE_bool("compare", False, "arguments are LABEL=WORKDIR runs: one figure")
_METRIC = flags.DEFINE_string("metric", "eval/accuracy", "with --compare: the metric drawn")


def read_records(path: str) -> list[dict]:
    """The records of a metrics JSONL file. A line that does not parse (a run killed while
    writing it) is reported on stderr and skipped."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                # Metrics of older runs under their current names (espo_jax.zve.accounting).
                records.append(accounting.current_names(json.loads(line)))
            except json.JSONDecodeError:
                print(f"{path}:{n}: skipping a malformed line {line[:60]!r}", file=sys.stderr)
    return records


def series(records: list[dict], pattern: str) -> dict[str, list[tuple[int, float]]]:
    """`{metric: [(step, value), ...]}` sorted by step for the metrics `pattern` names, from
    records of PHASES; a later record of the same step replaces an earlier one."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        if r.get("phase") not in PHASES:
            continue
        for key, value in r.items():
            match = key.startswith(pattern[:-1]) if pattern.endswith("*") else key == pattern
            if match and isinstance(value, int | float) and not isinstance(value, bool):
                out.setdefault(key, {})[int(r["step"])] = float(value)
    return {k: sorted(v.items()) for k, v in sorted(out.items())}


def plot_run(workdir: str, out_dir: str | None = None) -> list[str]:
    """Writes one PNG per topic with data; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir} a finished run's workdir?")
    records = read_records(path)
    out_dir = out_dir or os.path.join(workdir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for topic, patterns in TOPICS.items():
        curves = {}
        for pattern in patterns:
            curves.update(series(records, pattern))
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, pts in curves.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=key)
        ax.set_xlabel("RL step")
        ax.set_title(topic.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        png = os.path.join(out_dir, f"{topic}.png")
        fig.savefig(png, dpi=110)
        plt.close(fig)
        written.append(png)
    return written


def compare_runs(runs: dict[str, str], out_png: str, metric: str = "eval/accuracy") -> dict:
    """`metric` of each run (label -> workdir) in one figure at `out_png`; the curves drawn are
    returned and written beside it as JSON (`{label: [[step, value], ...]}`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for label, workdir in runs.items():
        path = os.path.join(workdir, "metrics.jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: is {workdir} a finished run's workdir?")
        pts = series(read_records(path), metric).get(metric)
        if not pts:
            raise ValueError(f"{path} has no {metric!r} records")
        curves[label] = pts
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, pts in curves.items():
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker=".", label=label)
    ax.set_xlabel("RL step")
    ax.set_title(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    with open(os.path.splitext(out_png)[0] + ".json", "w") as f:
        json.dump({"metric": metric, "runs": runs, "curves": curves}, f, indent=1)
    return curves


def _compare_main(argv: list[str]) -> int:
    if not _OUT.value or len(argv) < 2 or not all("=" in a for a in argv[1:]):
        raise app.UsageError("--compare needs --out FILE.png and LABEL=WORKDIR arguments")
    runs = dict(a.split("=", 1) for a in argv[1:])
    try:
        compare_runs(runs, _OUT.value, _METRIC.value)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_OUT.value)
    return 0


def main(argv: list[str]) -> int:
    if _COMPARE.value:
        return _compare_main(argv)
    if len(argv) != 2:
        raise app.UsageError(f"give one WORKDIR; got {' '.join(argv[1:]) or 'none'}")
    workdir = argv[1]
    try:
        written = plot_run(workdir, _OUT.value)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not written:
        print(f"error: no plottable metrics in {workdir}/metrics.jsonl", file=sys.stderr)
        return 1
    for png in written:
        print(png)
    return 0


if __name__ == "__main__":
    app.run(main)
