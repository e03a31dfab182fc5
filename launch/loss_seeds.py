"""The five losses over seeds, on-policy and off-policy, at an equal budget of generated tokens.

    python launch/loss_seeds.py --workdir /tmp/loss_seeds [--seeds=0,1,2] [--jobs=2]
        [--max_tokens=260000] [--settings=on,off] [--losses=espo,grpo,dapo,gspo,gspo_token]

For each seed S (`--config.seed=S`: the data split seeds, the warm start, the RL sampling):

1. WORKDIR/warm/seedS: the supervised warm start of `experiments/arith_espo.py` alone
   (`train.steps=0`), evaluated on validation and test.
2. WORKDIR/SETTING/LOSS/seedS: RL with `experiments/arith_LOSS.py` from that warm start
   (`checkpoint.init_from`), until `--max_tokens` generated tokens (`train.max_tokens`, the
   stage-0 pass included; `train.steps` is only a cap), evaluated on the validation split every
   `--eval_every` steps and once on the test split at the end (`eval.final_test`). Setting `on`:
   one update per rollout batch (the recipe, ratios 1); `off`: `--off_updates` minibatch updates
   per batch (ratios depart from 1 and the clips act).

Runs are seed-major (every loss of seed 0, then seed 1, ...), so a stopped launch leaves whole
seeds. Every run executes WORKDIR/code, a copy of the package and experiments made at the first
launch (its commit in WORKDIR/code/commit.txt and in the results json). Every run is a real main
job (a subprocess; its log in WORKDIR/logs/ and WORKDIR/.../log.txt); a finished run (its
summary.json present) is not run again, so the same command resumes. It writes
WORKDIR/loss_seeds.json (every run's numbers, the aggregates, the commit, the CPU, the flags),
WORKDIR/loss_seeds.md (the README's tables), WORKDIR/loss_seeds.png (validation accuracy
against RL step, mean and min-max band over seeds) and WORKDIR/loss_seeds_espo_eps.png (ESPO's
clip ranges against entropy). Only the test split's numbers are reported; validation is where
settings are chosen.

`--merge=FILE` (a json written here, e.g. the stored loss_seeds_chosen_lr.json) adds the stored
runs and warm starts that WORKDIR lacks, so new seeds extend a stored comparison without rerunning
it; every run keeps the commit it ran on, and a seed whose warm start is in both places must score
the same in both. Every run also keeps its `--override`s (a stored file's runs: the file's); the
seeds of one cell (setting, loss) must share them, and a table column names the overrides of its
setting, so e.g. the off-policy column can be rerun at another lr and joined to the stored
on-policy one (`--override optim.lr=1e-4 --merge FILE`, WORKDIR holding only off-policy runs).
"""

from __future__ import annotations

import concurrent.futures
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

from espo_jax import plot as run_plots  # noqa: E402  (the metrics.jsonl reader; no JAX)

REPO = main_jobs.REPO
LOSSES = ("espo", "grpo", "dapo", "gspo", "gspo_token")
SETTINGS = ("on", "off")


def define_flags() -> None:
    """The command line (defined when run as a script, so tests can import the module beside
    other launchers that define the same names)."""
    flags.DEFINE_string("workdir", None, "one subdirectory per run, and the results")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (each with its own warm start)")
    flags.DEFINE_list("losses", list(LOSSES), "losses (experiments/arith_LOSS.py)")
    flags.DEFINE_list("settings", list(SETTINGS), "on: 1 update per batch; off: several")
    flags.DEFINE_integer("max_tokens", 260_000, "generated tokens per RL run")
    flags.DEFINE_integer("max_steps", 120, "RL steps at most (the schedule's length)")
    flags.DEFINE_integer("off_updates", 4, "minibatch updates per batch, setting off")
    flags.DEFINE_integer("eval_every", 6, "RL steps between validation evaluations")
    flags.DEFINE_integer("jobs", 1, "main jobs at a time (they share the CPU)", lower_bound=1)
    flags.DEFINE_bool("small", False, "the experiments' small variants: a smoke test")
    flags.DEFINE_multi_string("override", [], "x.y=v: --config.x.y=v for every run")
    flags.DEFINE_bool("report_only", False, "run nothing: the tables, json and plots of the "
                      "runs that have finished (a cell lists the seeds it has)")
    flags.DEFINE_string("merge", None, "a stored loss_seeds.json: its runs and warm starts of "
                        "the chosen seeds, losses and settings that WORKDIR lacks join the "
                        "report, each with the commit it ran on")
    flags.mark_flag_as_required("workdir")


def snapshot(workdir: str) -> str:
    """WORKDIR/code: a copy of the package and the experiments, made at the first launch. Every
    run executes it, so the runs of one comparison run the same code even when the checkout
    changes during the hours they take, or between a launch and its resumption."""
    code = os.path.join(workdir, "code")
    if not os.path.isdir(code):
        ignore = shutil.ignore_patterns("__pycache__")
        tmp = code + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        for name in ("espo_jax", "experiments"):
            shutil.copytree(os.path.join(REPO, name), os.path.join(tmp, name), ignore=ignore)
        with open(os.path.join(tmp, "commit.txt"), "w") as f:
            f.write(_commit() + "\n")
        os.rename(tmp, code)
    return code


def run_main(run_dir: str, experiment: str, run_flags: list[str], small: bool, logs: str,
             code: str) -> dict:
    """One main job in `run_dir` on the package in `code` (skipped when its summary exists)."""
    label = os.path.relpath(run_dir, os.path.dirname(logs))
    return main_jobs.run_main(run_dir, experiment, run_flags, label=label, small=small,
                              log_path=os.path.join(logs, label.replace(os.sep, "_") + ".log"),
                              code=code)


def common_flags(seed: int, eval_every: int) -> list[str]:
    return [f"--config.seed={seed}", "--config.eval.split=validation",
            "--config.eval.final_test=True", f"--config.eval.every={eval_every}"]


def rl_flags(setting: str, warm_dir: str, max_tokens: int, max_steps: int,
             off_updates: int) -> list[str]:
    return [f"--config.checkpoint.init_from={os.path.join(warm_dir, 'warmstart')}",
            f"--config.train.max_tokens={max_tokens}", f"--config.train.steps={max_steps}",
            f"--config.train.updates_per_batch={1 if setting == 'on' else off_updates}"]


def _records(run_dir: str) -> list[dict]:
    return run_plots.read_records(os.path.join(run_dir, "metrics.jsonl"))


def validation_curve(run_dir: str) -> list[tuple[int, float]]:
    """(RL step, validation accuracy) of every evaluation of a run, in step order."""
    return run_plots.series(_records(run_dir), "eval/accuracy").get("eval/accuracy", [])


def clip_stats(run_dir: str) -> dict[str, float]:
    """Means over RL steps of the clip fractions and ratio tails (what says the clips acted)."""
    keys = ("pg/clipfrac_low", "pg/clipfrac_high", "is_ratio/p01", "is_ratio/p99",
            "espo/eps_mean")
    rl = [r for r in _records(run_dir) if r["phase"] == "rl" and r["step"] > 0]
    values = {k: [r[k] for r in rl if r.get(k) is not None] for k in keys}
    return {k: statistics.fmean(v) for k, v in values.items() if v}


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def aggregate(runs: dict, warm: dict) -> dict:
    """Per setting and loss: test accuracy and its gain over the seed's warm start, mean +- std
    (sample std over seeds) and every seed; tokens, steps and RL seconds; the `--config`
    overrides its runs share (seeds run with different overrides are not one cell: an error)."""
    out: dict = {}
    for setting, by_loss in runs.items():
        for loss, by_seed in by_loss.items():
            seeds = sorted(by_seed)
            overrides = {s: by_seed[s].get("overrides", []) for s in seeds}
            if len({tuple(o) for o in overrides.values()}) > 1:
                raise ValueError(f"{setting}-policy {loss}: its seeds ran with different "
                                 f"overrides {overrides}; one cell must share its settings")
            out.setdefault(setting, {})[loss] = {
                "seeds": seeds, "overrides": overrides[seeds[0]],
                "test_accuracy": mean_std([by_seed[s]["test_accuracy"] for s in seeds]),
                "test_gain": mean_std([by_seed[s]["test_accuracy"] - warm[s]["test_accuracy"]
                                       for s in seeds]),
                "validation_accuracy": mean_std([by_seed[s]["final_accuracy"] for s in seeds]),
                "generated_tokens": mean_std([by_seed[s]["generated_tokens"] for s in seeds]),
                "steps": mean_std([by_seed[s]["steps"] for s in seeds]),
                "rl_seconds": mean_std([by_seed[s]["rl_seconds"] for s in seeds]),
            }
    return out


def table(agg: dict, warm: dict) -> str:
    """Markdown: one row per loss, test accuracy (mean +- std, then each seed) per setting."""
    seeds = sorted(warm)
    start = [warm[s]["test_accuracy"] for s in seeds]
    settings = list(agg)
    def shared(setting):  # the overrides every loss of the setting ran with, if one list
        lists = {tuple(a.get("overrides", [])) for a in agg[setting].values()}
        only = lists.pop() if len(lists) == 1 else ()
        return f" [{', '.join(o.removeprefix('--config.') for o in only)}]" if only else ""

    head = ["loss"] + [f"{s}-policy{shared(s)}: test acc (mean +- std, seeds) / each seed / gain"
                       for s in settings]
    head += [f"{s}: RL steps, RL s" for s in settings]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append("| warm start | " + " | ".join(
        [f"{statistics.fmean(start):.3f} +- {statistics.stdev(start) if len(start) > 1 else 0:.3f}"
         f" / {' '.join(f'{v:.3f}' for v in start)} / -"] * len(settings)
        + ["-"] * len(settings)) + " |")
    losses = list(dict.fromkeys(loss for s in settings for loss in agg[s]))
    for loss in losses:
        cells, costs = [], []
        for s in settings:
            a = agg[s].get(loss)
            if a is None:
                cells.append("-")
                costs.append("-")
                continue
            acc, gain = a["test_accuracy"], a["test_gain"]
            cells.append(f"{acc['mean']:.3f} +- {acc['std']:.3f} (n={len(acc['values'])}) / "
                         f"{' '.join(f'{v:.3f}' for v in acc['values'])} / "
                         f"{100 * gain['mean']:+.1f} +- {100 * gain['std']:.1f} pts")
            costs.append(f"{a['steps']['mean']:.1f}, {a['rl_seconds']['mean']:.0f}")
        lines.append(f"| {loss} | " + " | ".join(cells + costs) + " |")
    return "\n".join(lines)


def clip_table(clips: dict) -> str:
    """Markdown: per setting and loss, the means over seeds of the per-run step means of the
    clip fractions and importance-ratio tails (ESPO: its mean eps)."""
    head = ["setting", "loss", "clip frac low", "clip frac high", "ratio p01", "ratio p99",
            "ESPO mean eps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setting, by_loss in clips.items():
        for loss, by_seed in by_loss.items():
            cells = []
            for key in ("pg/clipfrac_low", "pg/clipfrac_high", "is_ratio/p01", "is_ratio/p99",
                        "espo/eps_mean"):
                vals = [c[key] for c in by_seed.values() if key in c]
                cells.append(f"{statistics.fmean(vals):.4g}" if vals else "-")
            lines.append(f"| {setting} | {loss} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def espo_eps_points(run_dir: str) -> list[tuple[float, float, float]]:
    """(entropy/mean, espo/eps_low, espo/eps_high) of every RL step of an ESPO run."""
    return [(r["entropy/mean"], r["espo/eps_low"], r["espo/eps_high"])
            for r in _records(run_dir) if r["phase"] == "rl"
            and r.get("espo/eps_high") is not None and r.get("entropy/mean") is not None]


def plot_espo_eps(points: dict, path: str) -> None:
    """ESPO's per-step clip ranges of its low- and high-entropy token groups against the step's
    mean token entropy, every seed and setting: eps_tau = alpha * mean entropy of tau / log|V|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setting, by_seed in points.items():
        pts = [p for seed_pts in by_seed.values() for p in seed_pts]
        if not pts:
            continue
        ent = [p[0] for p in pts]
        ax.scatter(ent, [p[2] for p in pts], s=10, marker="o" if setting == "on" else "^",
                   label=f"{setting}-policy: high-entropy group")
        ax.scatter(ent, [p[1] for p in pts], s=10, marker="o" if setting == "on" else "^",
                   label=f"{setting}-policy: low-entropy group")
    ax.set_xlabel("mean token entropy of the step (nats)")
    ax.set_ylabel("ESPO clip range eps")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("ESPO's entropy-adaptive clip, one point per RL step and seed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(curves: dict, path: str) -> None:
    """Validation accuracy against RL step per setting: each loss's mean over seeds, with the
    min-max band of its seeds, at the steps every seed evaluated and at the end of RL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.2), squeeze=False)
    for ax, (setting, by_loss) in zip(axes[0], curves.items(), strict=True):
        for loss, by_seed in by_loss.items():
            # The evaluations every seed made before its last, then the last one (runs stop
            # at the token budget, one step apart), drawn at the seeds' mean last step.
            steps = sorted(set.intersection(*(set(dict(c[:-1])) for c in by_seed.values())))
            ys = np.array([[dict(c)[t] for t in steps] + [c[-1][1]] for c in by_seed.values()])
            steps = steps + [float(np.mean([c[-1][0] for c in by_seed.values()]))]
            line, = ax.plot(steps, ys.mean(0), marker="o", ms=3, label=f"{loss} ({len(ys)})")
            ax.fill_between(steps, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
        ax.set_title(f"{setting}-policy ({'1 update' if setting == 'on' else 'several updates'}"
                     " per rollout batch)")
        ax.set_xlabel("RL step")
        ax.set_ylabel("validation greedy accuracy")
        ax.legend(fontsize=8, title="loss (seeds)")
        ax.grid(alpha=0.3)
    fig.suptitle("arith_chains: mean over seeds, band = min-max of the seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TRIM = ("warmstart_accuracy", "final_accuracy", "test_accuracy", "steps", "generated_tokens",
        "no_signal_token_frac", "no_signal_token_frac_with_offline", "mean_abs_logp_mismatch",
        "rl_seconds", "skipped_updates", "test", "final")
WARM_TRIM = ("test_accuracy", "final_accuracy", "warmstart_seconds", "test")


def stored(path: str, seeds: list[int], settings: list[str], losses: list[str]
           ) -> tuple[dict, dict]:
    """A results json written by this script: its warm starts {seed: entry} and runs
    {(seed, setting, loss): entry} of the chosen seeds, settings and losses. Every entry carries
    the commit it ran on (its own, or the file's for files that stored one commit for all) and a
    run's entry its ESPO eps points."""
    with open(path) as f:
        result = json.load(f)
    warm = {int(s): {"commit": result["commit"], **w} for s, w in result["warm"].items()
            if int(s) in seeds}
    points = result.get("espo_eps_points", {})
    overrides = result.get("flags", {}).get("override", [])  # files that stored one list
    runs = {}
    for setting, by_loss in result["runs"].items():
        for loss, by_seed in by_loss.items():
            for s, r in by_seed.items():
                if int(s) in seeds and setting in settings and loss in losses:
                    runs[int(s), setting, loss] = {
                        "commit": result["commit"], "overrides": overrides, **r,
                        "validation_curve": [tuple(p) for p in r["validation_curve"]],
                        "espo_eps_points": [tuple(p) for p in
                                            points.get(setting, {}).get(s, [])]}
    return warm, runs


def merge(warm: dict, runs: dict, warm_in: dict, runs_in: dict, source: str) -> None:
    """Adds to `warm` and `runs` (WORKDIR's) the entries of `warm_in` and `runs_in` (a stored
    file's) that WORKDIR lacks. A seed whose warm start is in both must score the same on test
    in both: its runs from either place then start from the same model (the check is what says
    the two commits train alike)."""
    for seed, w in warm_in.items():
        if seed not in warm:
            warm[seed] = w
        elif warm[seed]["test_accuracy"] != w["test_accuracy"]:
            raise ValueError(
                f"--merge={source}: seed {seed}'s warm start scores "
                f"{warm[seed]['test_accuracy']} on test in WORKDIR and {w['test_accuracy']} "
                f"in the file (commit {w['commit']}): the runs would not share a start")
    for key, r in runs_in.items():
        if key not in runs and key[0] in warm:
            runs[key] = r


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "espo_jax", "experiments"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+uncommitted" if dirty else "")


def _cpu() -> str:
    """The CPU's model name and core count, and whether it has AVX-512: XLA's CPU code, and so
    the floats and a seed's warm start, differ between CPUs with and without it."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.machine())
    return f"{name} x{os.cpu_count()}, {'with' if 'avx512f' in info else 'without'} AVX-512"


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    for loss in FLAGS.losses:
        if loss not in LOSSES:
            raise app.UsageError(f"--losses: {loss!r} is not one of {LOSSES}")
    for setting in FLAGS.settings:
        if setting not in SETTINGS:
            raise app.UsageError(f"--settings: {setting!r} is not one of {SETTINGS}")
    workdir = os.path.abspath(FLAGS.workdir)
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    extra = [f"--config.{o}" for o in FLAGS.override]
    seeds = [int(s) for s in FLAGS.seeds]
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    code = snapshot(workdir)
    with open(os.path.join(code, "commit.txt")) as f:
        first_commit = f.read().strip()
    warm_dirs = {seed: os.path.join(workdir, "warm", f"seed{seed}") for seed in seeds}
    run_dirs = {(seed, setting, loss): os.path.join(workdir, setting, loss, f"seed{seed}")
                for seed in seeds for setting in FLAGS.settings for loss in FLAGS.losses}
    if FLAGS.report_only:  # what has finished, whatever is missing
        warm = {s: w for s in seeds if (w := main_jobs.summary(warm_dirs[s])) is not None}
        finished = {key: r for key, d in run_dirs.items()
                    if key[0] in warm and (r := main_jobs.summary(d)) is not None}
    else:
        # Warm starts first (they are what every run of a seed waits for), then the RL runs
        # seed-major; a run waits for its seed's warm start inside its pool slot (FIFO: that
        # warm start was submitted earlier, so it is running or done).
        with concurrent.futures.ThreadPoolExecutor(max_workers=FLAGS.jobs) as pool:
            warm_jobs = {seed: pool.submit(
                run_main, warm_dirs[seed], "arith_espo",
                common_flags(seed, 0) + extra + ["--config.train.steps=0"], FLAGS.small, logs,
                code) for seed in seeds}

            def rl_run(seed, run_dir, experiment, run_flags):
                warm_jobs[seed].result()
                return run_main(run_dir, experiment, run_flags, FLAGS.small, logs, code)

            jobs = {}
            for (seed, setting, loss), run_dir in run_dirs.items():
                run_flags = (common_flags(seed, FLAGS.eval_every) + extra
                             + rl_flags(setting, warm_dirs[seed], FLAGS.max_tokens,
                                        FLAGS.max_steps, FLAGS.off_updates))
                jobs[seed, setting, loss] = pool.submit(rl_run, seed, run_dir, f"arith_{loss}",
                                                        run_flags)
            warm = {seed: job.result() for seed, job in warm_jobs.items()}
            finished = {key: future.result() for key, future in jobs.items()}
    warm = {s: {"commit": first_commit, **{k: w[k] for k in WARM_TRIM if k in w}}
            for s, w in warm.items()}
    entries = {}
    for key, summary in finished.items():
        run_dir = run_dirs[key]
        entries[key] = {"commit": first_commit, "overrides": extra,
                        **{k: summary[k] for k in TRIM if k in summary},
                        "clip_means": clip_stats(run_dir),
                        "validation_curve": validation_curve(run_dir),
                        "espo_eps_points": espo_eps_points(run_dir) if key[2] == "espo" else []}
    if FLAGS.merge:
        merge(warm, entries, *stored(FLAGS.merge, seeds, FLAGS.settings, FLAGS.losses),
              FLAGS.merge)
    runs, curves, clips, points = {}, {}, {}, {}
    order = {name: i for i, name in enumerate([*FLAGS.settings, *FLAGS.losses])}
    for (seed, setting, loss), entry in sorted(
            entries.items(), key=lambda kv: (order[kv[0][1]], order[kv[0][2]], kv[0][0])):
        runs.setdefault(setting, {}).setdefault(loss, {})[seed] = entry
        curves.setdefault(setting, {}).setdefault(loss, {})[seed] = entry["validation_curve"]
        clips.setdefault(setting, {}).setdefault(loss, {})[seed] = entry["clip_means"]
        if loss == "espo":
            points.setdefault(setting, {})[seed] = entry["espo_eps_points"]
    warm = dict(sorted(warm.items()))
    agg = aggregate(runs, warm)
    text = table(agg, warm) + "\n\n" + clip_table(clips)
    print(text)
    with open(os.path.join(workdir, "loss_seeds.md"), "w") as f:
        f.write(text + "\n")
    commits = sorted({e["commit"] for e in [*warm.values(), *entries.values()]})
    result = {
        "commit": first_commit if len(commits) <= 1 else ", ".join(commits),
        "aggregated_at_commit": _commit(), "aggregated": started, "cpu": _cpu(),
        "jobs": FLAGS.jobs,
        "flags": {"max_tokens": FLAGS.max_tokens, "max_steps": FLAGS.max_steps,
                  "off_updates": FLAGS.off_updates, "eval_every": FLAGS.eval_every,
                  "small": FLAGS.small, "override": extra, "merge": FLAGS.merge},
        "warm": warm,
        "aggregate": agg,
        "runs": {st: {lo: {s: {k: v for k, v in r.items() if k != "espo_eps_points"}
                           for s, r in by_seed.items()} for lo, by_seed in by_loss.items()}
                 for st, by_loss in runs.items()},
        "espo_eps_points": points,
    }
    with open(os.path.join(workdir, "loss_seeds.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(curves, os.path.join(workdir, "loss_seeds.png"))
    if points:
        plot_espo_eps(points, os.path.join(workdir, "loss_seeds_espo_eps.png"))
    print(f"written: {workdir}/loss_seeds.md, loss_seeds.json, loss_seeds*.png")
    return 0


FLAGS = flags.FLAGS

if __name__ == "__main__":
    define_flags()
    app.run(main)
