"""Learning curves of a run: `python -m espo_jax.plot WORKDIR` writes PNGs to WORKDIR/plots.

Reads WORKDIR/metrics.jsonl. One figure per topic; a topic is drawn when any of its metrics was
logged: accuracy, reward, zero-variance fraction, train-inference mismatch, entropy, clipping.
"""

from __future__ import annotations

import argparse
import os
import sys

from espo_jax.train.metrics import read_jsonl

TOPICS = {
    "accuracy": ("eval/accuracy", "eval/pass_at_k", "rollout/accuracy"),
    "reward": ("rollout/reward_mean", "rollout/reward_max"),
    "zero_variance": (
        "zve/zero_variance_frac_before",
        "zve/zero_variance_frac_after",
        "zve/wasted_token_frac",
    ),
    "mismatch": ("mismatch/mean_abs_logp", "mismatch/kl_k3", "moe/routing_flip_rate"),
    "entropy": ("entropy/mean",),
    "clipping": ("pg/clipfrac_low", "pg/clipfrac_high", "pg/clipfrac"),
}


def plot_run(workdir: str, out_dir: str | None = None) -> list[str]:
    """Writes one PNG per topic with data; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir} a finished run's workdir?")
    records = [r for r in read_jsonl(path) if r.get("phase") in ("rl", "eval")]
    out_dir = out_dir or os.path.join(workdir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for topic, keys in TOPICS.items():
        series = {}
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if pts:
                series[key] = pts
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, pts in series.items():
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m espo_jax.plot")
    parser.add_argument("workdir")
    parser.add_argument("--out", default=None, help="output folder (default WORKDIR/plots)")
    args = parser.parse_args(argv)
    for png in plot_run(args.workdir, args.out):
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
