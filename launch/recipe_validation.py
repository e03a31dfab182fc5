"""The default experiment's recipe on the validation split, one value changed per run.

    python launch/recipe_validation.py --workdir /tmp/recipe_val [--init_from WARM/warmstart]
        [--seed=0] [--num_prompts=600] [--eval_every=40] [--jobs=2]
        [--change=NAME:KEY=VALUE ...] [--report_only]

Every run is `experiments/arith_espo.py` (the full recipe: 120 RL steps) from one warm start,
evaluated on `--num_prompts` prompts of the validation split every `--eval_every` steps and at
the end; the test split is not read. Run `recipe` is the recipe as it is; every `--change` runs
it with one `--config.KEY=VALUE` (default: anchor 0.5, 16 prompts per step, no step credit).
The warm start is `--init_from`, or the recipe's own (WORKDIR/warm, `train.steps=0`). Runs
execute WORKDIR/code (a copy of the package made at the first launch, as `loss_seeds.py` does);
a finished run is not run again, so the same command resumes. Writes
WORKDIR/recipe_validation.json (each run's final and per-evaluation validation accuracy, the
commit, the CPU) and WORKDIR/recipe_validation.png (the validation curves).
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

flags.DEFINE_string("workdir", None, "one subdirectory per run, and the results")
flags.DEFINE_string("init_from", None, "a warm start (WORKDIR/warmstart of a run); default: "
                    "the recipe's own, made in WORKDIR/warm")
flags.DEFINE_integer("seed", 0, "--config.seed of every run")
flags.DEFINE_integer("num_prompts", 600, "validation prompts per evaluation")
flags.DEFINE_integer("eval_every", 40, "RL steps between evaluations")
flags.DEFINE_integer("jobs", 2, "main jobs at a time", lower_bound=1)
flags.DEFINE_multi_string("change", list(CHANGES), "NAME:KEY=VALUE, one run per change")
flags.DEFINE_bool("report_only", False, "run nothing: the json and plot of finished runs")
flags.DEFINE_bool("small", False, "the experiment's small variant: a smoke test")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def parse_changes(changes: list[str]) -> dict[str, list[str]]:
    """{"recipe": [], NAME: ["--config.KEY=VALUE"]} from NAME:KEY=VALUE (a clear error else)."""
    runs: dict[str, list[str]] = {"recipe": []}
    for change in changes:
        name, sep, setting = change.partition(":")
        if not sep or not name or "=" not in setting or name in runs:
            raise app.UsageError(f"--change={change!r}: expected NAME:KEY=VALUE with a new NAME "
                                 "(e.g. anchor0.5:train.anchor_coef=0.5)")
        runs[name] = [f"--config.{setting}"]
    return runs


def report(workdir: str, runs: dict[str, list[str]]) -> dict:
    """The json (and plot) of the runs in WORKDIR that have finished."""
    with open(os.path.join(workdir, "code", "commit.txt")) as f:
        commit = f.read().strip()
    out = {"what": "arith_espo.py's recipe on the validation split, one value changed per run; "
                   "the test split is not read",
           "seed": FLAGS.seed, "num_prompts": FLAGS.num_prompts, "commit": commit,
           "cpu": loss_seeds._cpu(), "runs": {}}
    for name, extra in runs.items():
        run_dir = os.path.join(workdir, name)
        s = main_jobs.summary(run_dir)
        if s is None:
            continue
        out["runs"][name] = {
            "change": [e.removeprefix("--config.") for e in extra],
            "validation_accuracy": s["final_accuracy"],
            "validation_at_start": s["warmstart_accuracy"],
            "validation_curve": [list(p) for p in loss_seeds.validation_curve(run_dir)],
            "steps": s["steps"], "generated_tokens": s["generated_tokens"],
            "rl_seconds": s["rl_seconds"]}
        print(f"{name:12s} {' '.join(out['runs'][name]['change']) or 'the recipe':40s} "
              f"{s['warmstart_accuracy']:.3f} -> {s['final_accuracy']:.3f}")
    with open(os.path.join(workdir, "recipe_validation.json"), "w") as f:
        json.dump(out, f, indent=1)
    if out["runs"]:
        plot(out, os.path.join(workdir, "recipe_validation.png"))
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run in result["runs"].values():
        xs, ys = zip(*run["validation_curve"], strict=True)
        label = " ".join(run["change"]) or "the recipe"
        ax.plot(xs, ys, marker="o", label=f"{label}: {run['validation_accuracy']:.3f}")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"validation greedy accuracy ({result['num_prompts']} prompts)")
    ax.set_title(f"arith_espo's recipe on validation: seed {result['seed']}, one change per run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    runs = parse_changes(FLAGS.change)
    workdir = os.path.abspath(FLAGS.workdir)
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    code = loss_seeds.snapshot(workdir)
    if not FLAGS.report_only:
        common = [f"--config.seed={FLAGS.seed}", "--config.eval.split=validation",
                  f"--config.eval.num_prompts={FLAGS.num_prompts}"]
        init_from = FLAGS.init_from
        if init_from is None:
            warm = os.path.join(workdir, "warm")
            main_jobs.run_main(warm, "arith_espo", common + ["--config.train.steps=0"],
                               label="warm", small=FLAGS.small,
                               log_path=os.path.join(logs, "warm.log"), code=code)
            init_from = os.path.join(warm, "warmstart")
        common += [f"--config.eval.every={FLAGS.eval_every}",
                   f"--config.checkpoint.init_from={os.path.abspath(init_from)}"]
        with concurrent.futures.ThreadPoolExecutor(max_workers=FLAGS.jobs) as pool:
            jobs = [pool.submit(main_jobs.run_main, os.path.join(workdir, name), "arith_espo",
                                common + extra, label=name, small=FLAGS.small,
                                log_path=os.path.join(logs, f"{name}.log"), code=code)
                    for name, extra in runs.items()]
            for job in jobs:
                job.result()
    report(workdir, runs)
    print(f"written: {workdir}/recipe_validation.json, recipe_validation.png")
    return 0


if __name__ == "__main__":
    app.run(main)
