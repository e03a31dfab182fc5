"""`launch/real_weights_seeds.py`: the learning-rate choice, the aggregates by hand, and the
report (json and png) of run directories laid out as main jobs leave them."""

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "real_weights_seeds", os.path.join(REPO, "launch", "real_weights_seeds.py"))
launcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launcher)


def test_choose_lr_takes_the_best_validation_and_the_smaller_rate_on_a_tie():
    assert launcher.choose_lr({"1e-5": {"validation_accuracy": 0.3},
                               "5e-5": {"validation_accuracy": 0.4}}) == "5e-5"
    assert launcher.choose_lr({"5e-5": {"validation_accuracy": 0.4},
                               "1e-5": {"validation_accuracy": 0.4}}) == "1e-5"


def test_aggregate_by_hand():
    runs = {"0": {"test_accuracy": 0.30, "wall_seconds": 100.0, "generated_tokens": 1000},
            "1": {"test_accuracy": 0.20, "wall_seconds": 300.0, "generated_tokens": 3000}}
    agg = launcher.aggregate(runs, before={"0": 0.20, "1": 0.20})
    # 0.30 and 0.20: mean 0.25, sample std sqrt(2 * 0.05^2 / 1) = 0.0707; gains 10 and 0 points
    assert agg["test_accuracy_mean"] == pytest.approx(0.25)
    assert agg["test_accuracy_std"] == pytest.approx(0.0707107, abs=1e-6)
    assert (agg["gain_points_mean"], agg["gain_points_std"]) == pytest.approx((5.0, 7.0710678))
    assert (agg["wall_seconds_mean"], agg["generated_tokens_mean"]) == (200.0, 2000)
    assert agg["seeds"] == ["0", "1"]


def _run_dir(path, test, val, curve, seconds=50.0):
    os.makedirs(path)
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump({"test_accuracy": test, "final_accuracy": val, "steps": max(curve),
                   "wall_seconds": seconds, "generated_tokens": 500,
                   "no_signal_token_frac": 0.5, "mean_abs_logp_mismatch": 1e-6,
                   "test": {"eval/accuracy": test, "eval/accuracy_level2": test}}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step, acc in curve.items():  # as the loop logs them: a periodic evaluation on
            f.write(json.dumps({"step": step, "phase": "rl", "train/loss": 0.0,  # its step's
                                "eval/accuracy": acc}) + "\n")  # line, the last one alone
        f.write(json.dumps({"step": max(curve), "phase": "eval",
                            "eval/accuracy": curve[max(curve)]}) + "\n")


def test_report_of_finished_runs(tmp_path):
    w = str(tmp_path)
    assert launcher.report(w, ["0", "1"], ["1e-5", "5e-5"], "cmd") is None  # nothing yet
    os.makedirs(os.path.join(w, "code"))
    with open(os.path.join(w, "code", "commit.txt"), "w") as f:
        f.write("abc\n")
    _run_dir(os.path.join(w, "base", "seed0"), 0.2, 0.25, {0: 0.25})
    _run_dir(os.path.join(w, "base", "seed1"), 0.1, 0.25, {0: 0.25})  # its own split
    _run_dir(os.path.join(w, "espo", "lr1e-5", "seed0"), 0.3, 0.30, {0: 0.25, 5: 0.30})
    _run_dir(os.path.join(w, "espo", "lr5e-5", "seed0"), 0.1, 0.20, {0: 0.25, 5: 0.20})
    _run_dir(os.path.join(w, "espo", "lr1e-5", "seed1"), 0.4, 0.35, {0: 0.25, 5: 0.35})
    _run_dir(os.path.join(w, "grpo", "lr1e-5", "seed0"), 0.2, 0.25, {0: 0.25, 5: 0.25})
    r = launcher.report(w, ["0", "1"], ["1e-5", "5e-5"], "cmd")
    assert r["lr"] == "1e-5" and r["before"]["1"]["test_accuracy"] == 0.1
    assert r["test_accuracy_before_mean"] == pytest.approx(0.15)
    assert r["lr_sweep"]["5e-5"]["validation_accuracy"] == 0.2
    espo, grpo = r["methods"]["espo"], r["methods"]["grpo"]
    assert espo["seeds"] == ["0", "1"] and grpo["seeds"] == ["0"]  # seed 1 of GRPO not run
    assert espo["test_accuracy_mean"] == pytest.approx(0.35)
    assert espo["gain_points_mean"] == pytest.approx(20.0)  # 0.3 - 0.2 and 0.4 - 0.1
    assert espo["runs"]["1"]["validation_curve"] == [(0, 0.25), (5, 0.35)]
    assert espo["runs"]["0"]["test_per_level"] == {"2": 0.3}
    with open(os.path.join(w, "real_weights_seeds.json")) as f:
        assert json.load(f)["methods"]["grpo"]["test_accuracy_mean"] == 0.2
    assert os.path.getsize(os.path.join(w, "real_weights_seeds.png")) > 1000
