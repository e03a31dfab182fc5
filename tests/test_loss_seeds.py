"""`launch/loss_seeds.py`: the aggregates and tables by hand, then a real two-run launch on the
small variants (a warm start and one off-policy ESPO run from it) and its resumption."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "loss_seeds", os.path.join(REPO, "launch", "loss_seeds.py"))
launcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launcher)


def _run(test, val, tokens=1000, steps=10, seconds=100.0):
    return {"test_accuracy": test, "final_accuracy": val, "generated_tokens": tokens,
            "steps": steps, "rl_seconds": seconds}


def test_aggregate_and_table_by_hand():
    warm = {0: {"test_accuracy": 0.5}, 1: {"test_accuracy": 0.6}}
    runs = {"on": {"espo": {0: _run(0.7, 0.8), 1: _run(0.6, 0.7, steps=12)},
                   "grpo": {0: _run(0.5, 0.5), 1: _run(0.7, 0.6)}}}
    agg = launcher.aggregate(runs, warm)
    espo = agg["on"]["espo"]
    # test 0.7 and 0.6: mean 0.65, sample std sqrt(2 * 0.05^2 / 1) = 0.0707
    assert espo["test_accuracy"]["mean"] == pytest.approx(0.65)
    assert espo["test_accuracy"]["std"] == pytest.approx(0.0707107, abs=1e-6)
    # gains over each seed's own warm start: 0.2 and 0.0
    assert espo["test_gain"]["values"] == pytest.approx([0.2, 0.0])
    assert espo["validation_accuracy"]["mean"] == pytest.approx(0.75)
    assert espo["steps"]["mean"] == 11
    assert agg["on"]["grpo"]["test_gain"]["mean"] == pytest.approx(0.05)
    text = launcher.table(agg, warm)
    assert "| espo | 0.650 +- 0.071 (n=2) / 0.700 0.600 / +10.0 +- 14.1 pts | 11.0, 100 |" in text
    assert "| warm start | 0.550 +- 0.071 / 0.500 0.600 / - | - |" in text


def test_a_cell_shares_its_overrides_and_the_header_names_them():
    warm = {0: {"test_accuracy": 0.5}, 1: {"test_accuracy": 0.6}}
    lr = ["--config.optim.lr=1e-4"]
    runs = {"on": {"grpo": {0: _run(0.7, 0.8), 1: _run(0.6, 0.7)}},
            "off": {"grpo": {0: {**_run(0.7, 0.8), "overrides": lr},
                             1: {**_run(0.6, 0.7), "overrides": lr}}}}
    agg = launcher.aggregate(runs, warm)
    assert (agg["on"]["grpo"]["overrides"], agg["off"]["grpo"]["overrides"]) == ([], lr)
    head = launcher.table(agg, warm).splitlines()[0]
    assert "| on-policy: test acc" in head and "| off-policy [optim.lr=1e-4]: test acc" in head
    runs["off"]["grpo"][1]["overrides"] = []  # seed 1 at the default lr: not one cell
    with pytest.raises(ValueError, match="off-policy grpo: its seeds ran with different"):
        launcher.aggregate(runs, warm)


def test_report_only_aggregates_what_has_finished(tmp_path):
    """--report_only runs nothing: the warm start and the one finished run are reported, the
    missing runs are left out (an experiment that would fail if it were started)."""
    for rel, summary in (("warm/seed0", {"test_accuracy": 0.5, "final_accuracy": 0.4}),
                         ("on/grpo/seed0", _run(0.6, 0.55, steps=2))):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "summary.json").write_text(json.dumps(summary))
        (tmp_path / rel / "metrics.jsonl").write_text(json.dumps(
            {"step": 0, "phase": "eval", "eval/accuracy": 0.4}) + "\n")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "commit.txt").write_text("abc\n")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "loss_seeds.py"),
                           f"--workdir={tmp_path}", "--seeds=0,1", "--report_only"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started" not in proc.stdout
    result = json.loads((tmp_path / "loss_seeds.json").read_text())
    assert result["commit"] == "abc" and list(result["runs"]) == ["on"]
    assert result["aggregate"]["on"]["grpo"]["test_gain"]["values"] == pytest.approx([0.1])
    with open("/proc/cpuinfo") as f:  # results are comparable within one CPU type only
        avx512 = "avx512f" in f.read()
    assert result["cpu"].endswith(f"{'with' if avx512 else 'without'} AVX-512"), result["cpu"]


def test_validation_curve_keeps_one_point_per_step(tmp_path):
    records = [{"step": 0, "phase": "eval", "eval/accuracy": 0.5},
               {"step": 1, "phase": "rl", "rollout/accuracy": 0.3},
               {"step": 2, "phase": "rl", "eval/accuracy": 0.55},
               {"step": 3, "phase": "eval", "eval/accuracy": 0.6, "test/accuracy": 0.58}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert launcher.validation_curve(str(tmp_path)) == [(0, 0.5), (2, 0.55), (3, 0.6)]


@pytest.mark.slow
def test_small_launch_runs_then_resumes_without_rerunning(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "launch", "loss_seeds.py"),
           f"--workdir={tmp_path}", "--small", "--seeds=0", "--losses=espo", "--settings=off",
           "--max_tokens=2500", "--max_steps=3", "--eval_every=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "loss_seeds.json").read_text())
    run = result["runs"]["off"]["espo"]["0"]
    # The small variant's stage-0 pass alone spends less than the budget: RL ran, and stopped
    # at the budget (or the step cap), the test split evaluated once at the end.
    assert 1 <= run["steps"] <= 3
    assert run["steps"] == 3 or run["generated_tokens"] >= 2500
    assert run["test_accuracy"] == run["test"]["eval/accuracy"]
    curve = run["validation_curve"]
    assert [step for step, _ in curve] == list(range(run["steps"] + 1))
    # RL starts from the seed's warm start: its step-0 evaluation is the warm start's, on the
    # same validation prompts with the same sampling key; its last is the run's final one.
    warm = result["warm"]["0"]
    assert curve[0][1] == run["warmstart_accuracy"] == warm["final_accuracy"]
    assert curve[-1][1] == run["final_accuracy"]
    assert result["aggregate"]["off"]["espo"]["test_gain"]["values"] == pytest.approx(
        [run["test_accuracy"] - warm["test_accuracy"]])
    assert result["commit"] == (tmp_path / "code" / "commit.txt").read_text().strip()
    assert (tmp_path / "loss_seeds.png").stat().st_size > 0
    assert (tmp_path / "loss_seeds_espo_eps.png").stat().st_size > 0
    assert "| off | espo |" in (tmp_path / "loss_seeds.md").read_text()
    # Four updates per batch: the ratios departed from 1 within a batch.
    assert run["clip_means"]["is_ratio/p01"] < 1.0
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already finished") == 2 and "started" not in again.stdout


def _finished(root, rel, summary):
    (root / rel).mkdir(parents=True)
    (root / rel / "summary.json").write_text(json.dumps(summary))
    (root / rel / "metrics.jsonl").write_text(json.dumps(
        {"step": 0, "phase": "eval", "eval/accuracy": summary["final_accuracy"]}) + "\n")


def test_merge_extends_a_stored_comparison(tmp_path):
    """--merge: a stored file's seed 0 joins WORKDIR's seed 1 (gains against each seed's own warm
    start, each run with its commit); the file's seed-1 run, which WORKDIR also has, is not
    taken; a seed-1 warm start that scores differently in the two places is refused."""
    stored = {"commit": "old", "warm": {"0": {"test_accuracy": 0.5, "final_accuracy": 0.5},
                                        "1": {"test_accuracy": 0.6, "final_accuracy": 0.6}},
              "runs": {"on": {"grpo": {
                  s: {**_run(acc, acc), "clip_means": {}, "validation_curve": [[0, acc]]}
                  for s, acc in (("0", 0.7), ("1", 0.1))}}},
              "espo_eps_points": {}}
    (tmp_path / "stored.json").write_text(json.dumps(stored))
    work = tmp_path / "work"
    _finished(work, "warm/seed1", {"test_accuracy": 0.6, "final_accuracy": 0.6})
    _finished(work, "on/grpo/seed1", _run(0.9, 0.8))
    (work / "code").mkdir()
    (work / "code" / "commit.txt").write_text("new\n")
    cmd = [sys.executable, os.path.join(REPO, "launch", "loss_seeds.py"), f"--workdir={work}",
           "--seeds=0,1", "--losses=grpo", "--settings=on", "--report_only",
           f"--merge={tmp_path / 'stored.json'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((work / "loss_seeds.json").read_text())
    grpo = result["aggregate"]["on"]["grpo"]
    # seed 0 from the file: 0.7 - 0.5; seed 1 from WORKDIR (not the file's 0.1): 0.9 - 0.6
    assert grpo["seeds"] == [0, 1]
    assert grpo["test_gain"]["values"] == pytest.approx([0.2, 0.3])
    runs = result["runs"]["on"]["grpo"]
    assert (runs["0"]["commit"], runs["1"]["commit"]) == ("old", "new")
    assert result["commit"] == "new, old"
    stored["warm"]["1"]["test_accuracy"] = 0.65
    (tmp_path / "stored.json").write_text(json.dumps(stored))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "seed 1's warm start scores 0.6" in proc.stderr
