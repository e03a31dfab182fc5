"""The default experiment's recipe on the validation split, one value changed per run, per seed.

    python launch/recipe_validation.py --workdir /tmp/recipe_val [--seeds=0,1,2]
        [--init_from 'WARM/seed{seed}/warmstart'] [--num_prompts=600] [--eval_every=40]
        [--jobs=2] [--change=NAME:KEY=VALUE[,KEY=VALUE...] ...] [--report_only]

Every run is `experiments/arith_espo.py` (the full recipe: 120 RL steps) from its seed's warm
start, evaluated on `--num_prompts` prompts of the validation split every `--eval_every` steps and
at the end; the test split is not read. Run `recipe` is the recipe as it is; every `--change` runs
it with its `--config.KEY=VALUE` settings (default, one setting each: anchor 0.5, 16 prompts per
step, no step credit). Runs live in WORKDIR/seed{S}/NAME. The warm start is `--init_from` (`{seed}`
in it becomes each seed), or the recipe's own per seed (WORKDIR/seed{S}/warm, `train.steps=0`).
Runs execute WORKDIR/code (a copy of the package made at the first launch, as `loss_seeds.py`
does); a finished run is not run again, so the same command resumes, and more seeds can be added
later. Writes WORKDIR/recipe_validation.json (per run and seed the final and per-evaluation
validation accuracy, the mean and std over seeds, each change's per-seed difference to the recipe
and their mean and std; the commit, the CPU) and WORKDIR/recipe_validation.png (the curves, a panel
per seed).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loss_seeds  # noqa: E402  (snapshot, commit, CPU and curve readers, beside this script)
import main_jobs  # noqa: E402

CHANGES = ("anchor0.5:train.anchor_coef=0.5", "prompts16:rollout.prompts_per_step=16",
           "credit_zero:zve.tie_break.wrong_score=zero")

flags.DEFINE_string("workdir", None, "one subdirectory per seed and run, and the results")
flags.DEFINE_string("init_from", None, "a warm start (WORKDIR/warmstart of a run), '{seed}' "
                    "replaced by each seed; default: the recipe's own, in WORKDIR/seed{S}/warm")
flags.DEFINE_list("seeds", ["0"], "--config.seed of the runs: one set of runs per seed")
flags.DEFINE_integer("num_prompts", 600, "validation prompts per evaluation")
flags.DEFINE_integer("eval_every", 40, "RL steps between evaluations")
flags.DEFINE_integer("jobs", 2, "main jobs at a time", lower_bound=1)
flags.DEFINE_multi_string("change", list(CHANGES),
                          "NAME:KEY=VALUE[,KEY=VALUE...], one run per change")
flags.DEFINE_bool("report_only", False, "run nothing: the json and plot of finished runs")
flags.DEFINE_bool("small", False, "the experiment's small variant: a smoke test")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def parse_changes(changes: list[str]) -> dict[str, list[str]]:
    """{"recipe": [], NAME: ["--config.KEY=VALUE", ...]} from NAME:KEY=VALUE[,KEY=VALUE...]
    (a clear error else)."""
    runs: dict[str, list[str]] = {"recipe": []}
    for change in changes:
        name, sep, settings = change.partition(":")
        pairs = [s.partition("=") for s in settings.split(",")]
        if not sep or not name or name in runs or not all(k and eq for k, eq, _ in pairs):
            raise app.UsageError(f"--change={change!r}: expected NAME:KEY=VALUE[,KEY=VALUE...] "
                                 "with a new NAME (e.g. anchor0.5:train.anchor_coef=0.5)")
        runs[name] = [f"--config.{k}={v}" for k, _, v in pairs]
    return runs


def parse_seeds(seeds: list[str]) -> list[int]:
    try:
        out = [int(s) for s in seeds]
    except ValueError:
        out = []
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise app.UsageError(f"--seeds={','.join(seeds)}: expected distinct integers >= 0")
    return out


def run_dir(workdir: str, seed: int, name: str) -> str:
    return os.path.join(workdir, f"seed{seed}", name)


def _per_seed(summaries: dict[str, dict], key: str) -> dict:
    return {seed: s[key] for seed, s in summaries.items()}


def report(workdir: str, runs: dict[str, list[str]], seeds: list[int]) -> dict:
    """The json (and plot) of the runs in WORKDIR that have finished: per run, each seed's
    validation accuracy and curve, the mean and std over its seeds, and (a change) its per-seed
    difference to the recipe, on the seeds both finished."""
    with open(os.path.join(workdir, "code", "commit.txt")) as f:
        commit = f.read().strip()
    out = {"what": "arith_espo.py's recipe on the validation split, one value changed per run; "
                   "the test split is not read",
           "seeds": seeds, "num_prompts": FLAGS.num_prompts, "commit": commit,
           "cpu": loss_seeds._cpu(), "runs": {}}
    for name, extra in runs.items():
        done = {str(seed): s for seed in seeds
                if (s := main_jobs.summary(run_dir(workdir, seed, name))) is not None}
        if not done:
            continue
        accuracy = _per_seed(done, "final_accuracy")
        entry = {
            "change": [e.removeprefix("--config.") for e in extra],
            "validation_accuracy": accuracy,
            "over_seeds": loss_seeds.mean_std(list(accuracy.values())),
            "validation_at_start": _per_seed(done, "warmstart_accuracy"),
            "validation_curve": {seed: [list(p) for p in loss_seeds.validation_curve(
                run_dir(workdir, int(seed), name))] for seed in done},
            **{key: _per_seed(done, key) for key in ("steps", "generated_tokens", "rl_seconds")}}
        recipe = out["runs"].get("recipe", {}).get("validation_accuracy", {})
        if extra and (both := [seed for seed in accuracy if seed in recipe]):
            entry["minus_recipe"] = {seed: accuracy[seed] - recipe[seed] for seed in both}
            entry["minus_recipe_over_seeds"] = loss_seeds.mean_std(
                list(entry["minus_recipe"].values()))
        out["runs"][name] = entry
        over = entry["over_seeds"]
        against = (" vs recipe " + " ".join(f"{d:+.3f}" for d in entry["minus_recipe"].values())
                   if "minus_recipe" in entry else "")
        print(f"{name:12s} {' '.join(entry['change']) or 'the recipe':40s} "
              f"{' '.join(f'{a:.3f}' for a in accuracy.values())} (seeds "
              f"{','.join(accuracy)}): {over['mean']:.3f} +- {over['std']:.3f}{against}")
    with open(os.path.join(workdir, "recipe_validation.json"), "w") as f:
        json.dump(out, f, indent=1)
    if out["runs"]:
        plot(out, os.path.join(workdir, "recipe_validation.png"))
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = [str(s) for s in result["seeds"]]
    fig, axes = plt.subplots(1, len(seeds), figsize=(4.6 * len(seeds) + 1.0, 4.2),
                             sharey=True, squeeze=False)
    for ax, seed in zip(axes[0], seeds, strict=True):
        for run in result["runs"].values():
            if seed not in run["validation_curve"]:
                continue
            xs, ys = zip(*run["validation_curve"][seed], strict=True)
            label = " ".join(run["change"]) or "the recipe"
            ax.plot(xs, ys, marker="o", label=f"{label}: {run['validation_accuracy'][seed]:.3f}")
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"validation greedy accuracy ({result['num_prompts']} prompts)")
    fig.suptitle("arith_espo's recipe on validation, one change per run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    runs = parse_changes(FLAGS.change)
    seeds = parse_seeds(FLAGS.seeds)
    if FLAGS.init_from and len(seeds) > 1 and "{seed}" not in FLAGS.init_from:
        raise app.UsageError(f"--init_from={FLAGS.init_from} has no '{{seed}}': every seed "
                             "would start from the same warm start")
    workdir = os.path.abspath(FLAGS.workdir)
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    code = loss_seeds.snapshot(workdir)
    if not FLAGS.report_only:
        def common(seed: int) -> list[str]:
            return [f"--config.seed={seed}", "--config.eval.split=validation",
                    f"--config.eval.num_prompts={FLAGS.num_prompts}"]

        with concurrent.futures.ThreadPoolExecutor(max_workers=FLAGS.jobs) as pool:
            if FLAGS.init_from is None:  # each seed's own warm start first
                warm = {seed: pool.submit(
                    main_jobs.run_main, run_dir(workdir, seed, "warm"), "arith_espo",
                    common(seed) + ["--config.train.steps=0"], label=f"seed{seed}/warm",
                    small=FLAGS.small, log_path=os.path.join(logs, f"seed{seed}_warm.log"),
                    code=code) for seed in seeds}
                for job in warm.values():
                    job.result()
            jobs = []
            for seed in seeds:
                init_from = (FLAGS.init_from.replace("{seed}", str(seed)) if FLAGS.init_from
                             else os.path.join(run_dir(workdir, seed, "warm"), "warmstart"))
                flags_seed = common(seed) + [
                    f"--config.eval.every={FLAGS.eval_every}",
                    f"--config.checkpoint.init_from={os.path.abspath(init_from)}"]
                jobs += [pool.submit(main_jobs.run_main, run_dir(workdir, seed, name),
                                     "arith_espo", flags_seed + extra, label=f"seed{seed}/{name}",
                                     small=FLAGS.small, code=code,
                                     log_path=os.path.join(logs, f"seed{seed}_{name}.log"))
                         for name, extra in runs.items()]
            for job in jobs:
                job.result()
    report(workdir, runs, seeds)
    print(f"written: {workdir}/recipe_validation.json, recipe_validation.png")
    return 0


if __name__ == "__main__":
    app.run(main)
