"""ESPO with every MS-ZVE stage against GRPO from SmolLM2-135M-Instruct, over seeds.

    python launch/real_weights_seeds.py --workdir /tmp/real_seeds [--seeds=0,1,2]
        [--lrs=1e-5,5e-5] [--steps=15] [--eval_every=5]

Every run is a main job of `experiments/smollm2_chain_sum.py` (ESPO) or its `:grpo` variant,
on WORKDIR/code (the repository's committed tree at the first launch, its commit in
WORKDIR/code/commit.txt), evaluated greedily on the validation split every `--eval_every` RL
steps and once on the test split at the end (`eval.final_test`):

1. WORKDIR/base/seedS: the checkpoint itself (`train.steps=0`) on seed S's validation and test
   splits: the starting accuracy of that seed's runs (greedy decoding).
2. WORKDIR/espo/lrL/seed<first>: ESPO at each of `--lrs`; the learning rate is the one with the
   highest final validation accuracy (ties: the smaller). GRPO runs at the same rate.
3. WORKDIR/espo/lrL/seedS and WORKDIR/grpo/lrL/seedS for every seed (seed-major), at that rate.

`--config.seed=S` seeds the task's splits (reasoning-gym draws each seed's own train,
validation and test questions), sampling and the RL step; a run's gain is over its seed's base.
A run whose summary.json exists is not run again: the same command resumes. It writes
WORKDIR/real_weights_seeds.json (every run's numbers and curves, the aggregates, the commit,
the CPU) and WORKDIR/real_weights_seeds.png (validation accuracy against RL step, each seed and
the mean). Only test numbers are reported; validation chose the task and the rate.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import main_jobs  # noqa: E402  (launch/main_jobs.py, beside this script)

REPO = main_jobs.REPO
EXPERIMENT = "smollm2_chain_sum"
METHODS = {"espo": "ESPO + MS-ZVE (stages 0-5)", "grpo": "GRPO"}


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "one subdirectory per run, and the results")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds of each method")
    flags.DEFINE_list("lrs", ["1e-5", "5e-5"], "ESPO learning rates tried on validation (first "
                      "seed)")
    flags.DEFINE_integer("steps", 15, "RL steps of every run")
    flags.DEFINE_integer("eval_every", 5, "RL steps between validation evaluations")
    flags.DEFINE_bool("small", False, "the experiment's `:small` variant: a smoke test")
    flags.DEFINE_bool("report_only", False, "run nothing: the json and plot of finished runs")
    flags.mark_flag_as_required("workdir")


def code_copy(workdir: str) -> str:
    """WORKDIR/code: the committed tree of the repository at the first launch."""
    code = os.path.join(workdir, "code")
    if not os.path.exists(os.path.join(code, "commit.txt")):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout.strip()
        shutil.rmtree(code, ignore_errors=True)
        os.makedirs(code)
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", code], input=archive, check=True)
        with open(os.path.join(code, "commit.txt"), "w") as f:
            f.write(commit + "\n")
    return code


def run_flags(steps: int, eval_every: int, seed: int | None = None,
              lr: str | None = None) -> list[str]:
    out = [f"--config.train.steps={steps}", "--config.eval.split=validation",
           "--config.eval.final_test=True", f"--config.eval.every={eval_every}"]
    if seed is not None:
        out.append(f"--config.seed={seed}")
    if lr is not None:
        out.append(f"--config.optim.lr={lr}")
    return out


def curve(run_dir: str) -> list[tuple[int, float]]:
    """(RL step, validation accuracy) of every evaluation in RUN_DIR/metrics.jsonl."""
    points: dict[int, float] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "eval/accuracy" in m:  # the periodic ones ride on their step's line
                points[int(m["step"])] = float(m["eval/accuracy"])
    return sorted(points.items())


def per_level(summary: dict) -> dict[str, float]:
    """Test accuracy per level (number of terms) of a summary."""
    return {k.removeprefix("eval/accuracy_level"): v for k, v in summary["test"].items()
            if k.startswith("eval/accuracy_level")}


def run_record(run_dir: str, summary: dict) -> dict:
    return {"test_accuracy": summary["test_accuracy"],
            "validation_accuracy": summary["final_accuracy"],
            "test_per_level": per_level(summary),
            "validation_curve": curve(run_dir), "wall_seconds": summary["wall_seconds"],
            "generated_tokens": summary["generated_tokens"],
            "no_signal_token_frac": summary.get("no_signal_token_frac"),
            "mean_abs_logp_mismatch": summary["mean_abs_logp_mismatch"]}


def cpu_model() -> str:
    """The first CPU's model name in /proc/cpuinfo (the machine's type elsewhere)."""
    from espo_jax.bench import cpu_model as named

    return named()[0] or platform.machine()


def choose_lr(sweep: dict[str, dict]) -> str:
    """The rate with the highest final validation accuracy (ties: the smaller rate)."""
    return max(sorted(sweep, key=float),
               key=lambda lr: sweep[lr]["validation_accuracy"])


def aggregate(runs: dict[str, dict], before: dict[str, float]) -> dict:
    """Means and sample stds over seeds; gains in points over each seed's `before`."""
    acc = [r["test_accuracy"] for r in runs.values()]
    gain = [100 * (r["test_accuracy"] - before[seed]) for seed, r in runs.items()]
    std = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
    return {"seeds": sorted(runs, key=int), "test_accuracy_mean": statistics.mean(acc),
            "test_accuracy_std": std(acc), "gain_points_mean": statistics.mean(gain),
            "gain_points_std": std(gain),
            "wall_seconds_mean": statistics.mean(r["wall_seconds"] for r in runs.values()),
            "generated_tokens_mean": statistics.mean(r["generated_tokens"]
                                                     for r in runs.values())}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.0), width_ratios=(3, 2))
    for i, ((method, cell), color) in enumerate(zip(result["methods"].items(), ("C0", "C1"),
                                                    strict=False)):
        curves = [dict(r["validation_curve"]) for r in cell["runs"].values()]
        for c in curves:
            ax.plot(list(c), list(c.values()), color=color, alpha=0.3, lw=1)
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        ax.plot(steps, [statistics.mean(c[s] for c in curves) for s in steps], color=color,
                lw=2, marker="o", label=f"{METHODS[method]} (mean of {len(curves)} seeds)")
        after = [r["test_accuracy"] for r in cell["runs"].values()]
        ax2.scatter([i] * len(after), after, color=color, zorder=3)
        ax2.errorbar([i + 0.15], [cell["test_accuracy_mean"]], [cell["test_accuracy_std"]],
                     color=color, marker="s", capsize=4)
    before = [b["test_accuracy"] for b in result["before"].values()]
    for i in range(len(result["methods"])):
        ax2.scatter([i - 0.15] * len(before), before, color="gray", marker="x",
                    label="the checkpoint (each seed's split)" if i == 0 else None)
    ax2.set_xticks(range(len(result["methods"])),
                   [m.upper() for m in result["methods"]])
    ax2.set_xlim(-0.5, len(result["methods"]) - 0.3)
    ax2.set_ylabel("greedy test accuracy, after RL")
    ax2.set_title("each seed; mean +- std")
    ax2.legend(fontsize=8)
    ax.set_xlabel("RL step")
    ax.set_ylabel("greedy validation accuracy")
    ax.set_title(f"SmolLM2-135M-Instruct, chain_sum (lr {result['lr']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(workdir: str, seeds: list[str], lrs: list[str], command: str) -> dict | None:
    """The json (and png) of the finished runs; None before the base and the sweep finish."""
    bases = {seed: main_jobs.summary(os.path.join(workdir, "base", f"seed{seed}"))
             for seed in seeds}
    sweep = {lr: main_jobs.summary(os.path.join(workdir, "espo", f"lr{lr}", f"seed{seeds[0]}"))
             for lr in lrs}
    if bases[seeds[0]] is None or any(s is None for s in sweep.values()):
        return None
    sweep_runs = {lr: run_record(os.path.join(workdir, "espo", f"lr{lr}", f"seed{seeds[0]}"), s)
                  for lr, s in sweep.items()}
    lr = choose_lr(sweep_runs)
    with open(os.path.join(workdir, "code", "commit.txt")) as f:
        commit = f.read().strip()
    result = {"command": command, "commit": commit,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "cpus": os.cpu_count(),
              "experiment": f"experiments/{EXPERIMENT}.py", "steps": None,
              "before": {seed: {"test_accuracy": b["test_accuracy"],
                                "validation_accuracy": b["final_accuracy"],
                                "test_per_level": per_level(b)}
                         for seed, b in bases.items() if b is not None},
              "lr_sweep": {k: {"validation_accuracy": v["validation_accuracy"],
                               "validation_curve": v["validation_curve"]}
                           for k, v in sweep_runs.items()},
              "lr": lr, "methods": {}}
    before = [b["test_accuracy"] for b in result["before"].values()]
    result["test_accuracy_before_mean"] = statistics.mean(before)
    result["test_accuracy_before_std"] = statistics.stdev(before) if len(before) > 1 else 0.0
    for method in METHODS:
        runs = {}
        for seed in seeds:
            run_dir = os.path.join(workdir, method, f"lr{lr}", f"seed{seed}")
            s = main_jobs.summary(run_dir)
            if s is not None and bases[seed] is not None:
                runs[seed] = run_record(run_dir, s)
                result["steps"] = s["steps"]
        if runs:
            result["methods"][method] = {"name": METHODS[method], "runs": runs,
                                         **aggregate(runs, {k: b["test_accuracy"]
                                                            for k, b in bases.items() if b})}
    with open(os.path.join(workdir, "real_weights_seeds.json"), "w") as f:
        json.dump(result, f, indent=1)
    if result["methods"]:
        plot(result, os.path.join(workdir, "real_weights_seeds.png"))
    return result


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    workdir = os.path.abspath(f.workdir)
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    # as launched: the workdir named DIR, --report_only left out
    command = " ".join(["python", "launch/real_weights_seeds.py", "--workdir=DIR"] + [
        a for a in sys.argv[1:] if not a.startswith(("--workdir", "--report_only"))
        and a != workdir and a != f.workdir])
    if not f.report_only:
        code = code_copy(workdir)
        experiment = lambda m: EXPERIMENT if m == "espo" else f"{EXPERIMENT}:{m}"

        def job(name: str, method: str, run_flags_: list[str]) -> dict:
            exp = experiment(method)
            run_dir = os.path.join(workdir, name)
            os.makedirs(os.path.dirname(run_dir), exist_ok=True)
            return main_jobs.run_main(run_dir, exp, run_flags_, label=name, code=code,
                                      small=f.small,
                                      log_path=os.path.join(workdir, "logs",
                                                            name.replace("/", "_") + ".log"))

        for seed in f.seeds:
            job(f"base/seed{seed}", "espo", run_flags(0, f.eval_every, int(seed)))
        sweep = {lr: job(f"espo/lr{lr}/seed{f.seeds[0]}", "espo",
                         run_flags(f.steps, f.eval_every, int(f.seeds[0]), lr))
                 for lr in f.lrs}
        lr = choose_lr({k: {"validation_accuracy": s["final_accuracy"]}
                        for k, s in sweep.items()})
        print(f"lr {lr}: validation accuracy {sweep[lr]['final_accuracy']:.3f}"
              + (" (the highest of the sweep)" if len(sweep) > 1 else " (the only rate run)"),
              flush=True)
        for seed in f.seeds:
            for method in METHODS:
                job(f"{method}/lr{lr}/seed{seed}", method,
                    run_flags(f.steps, f.eval_every, int(seed), lr))
                report(workdir, f.seeds, f.lrs, command)
    result = report(workdir, f.seeds, f.lrs, command)
    if result is None:
        print("nothing to report yet (the base run and the sweep have not finished)")
        return
    print("test accuracy before: " + ", ".join(f"{s}: {b['test_accuracy']:.3f}"
                                                for s, b in result["before"].items())
          + f"; lr {result['lr']}")
    for cell in result["methods"].values():
        each = ", ".join(f"{s}: {r['test_accuracy']:.3f}" for s, r in cell["runs"].items())
        print(f"{cell['name']}: {cell['test_accuracy_mean']:.3f} +- "
              f"{cell['test_accuracy_std']:.3f} ({each})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
