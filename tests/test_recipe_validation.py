"""`launch/recipe_validation.py`: what it reports from finished runs, and bad changes refused
before anything runs (the runs themselves are main jobs, tested in test_main.py)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "recipe_validation.py")


def _finished(run_dir, start, curve):
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"warmstart_accuracy": start, "final_accuracy": curve[-1][1], "steps": 3,
                   "generated_tokens": 100, "rl_seconds": 1.0}, f)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step, acc in curve:
            f.write(json.dumps({"step": step, "phase": "eval" if step == 0 else "rl",
                                "eval/accuracy": acc}) + "\n")


def test_report_only_names_each_change_and_its_validation_curve(tmp_path):
    """Finished runs are reported with their change and curve, a missing one is left out, and
    nothing is started (a run that started would fail: there is no warm start)."""
    _finished(str(tmp_path / "recipe"), 0.5, [(0, 0.5), (2, 0.6), (3, 0.7)])
    _finished(str(tmp_path / "anchor0.5"), 0.5, [(0, 0.5), (2, 0.55), (3, 0.65)])
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "commit.txt").write_text("abc\n")
    proc = subprocess.run([sys.executable, SCRIPT, f"--workdir={tmp_path}", "--report_only"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started" not in proc.stdout
    result = json.loads((tmp_path / "recipe_validation.json").read_text())
    assert result["commit"] == "abc" and result["cpu"].endswith("AVX-512")
    assert list(result["runs"]) == ["recipe", "anchor0.5"]  # prompts16, credit_zero: not run
    assert result["runs"]["recipe"]["change"] == []
    assert result["runs"]["anchor0.5"]["change"] == ["train.anchor_coef=0.5"]
    assert result["runs"]["anchor0.5"]["validation_accuracy"] == pytest.approx(0.65)
    assert result["runs"]["anchor0.5"]["validation_curve"] == [[0, 0.5], [2, 0.55], [3, 0.65]]
    assert (tmp_path / "recipe_validation.png").stat().st_size > 0


@pytest.mark.parametrize("change", ["anchor", "x:train.anchor_coef", "recipe:optim.lr=1e-4"])
def test_a_malformed_change_is_refused_before_anything_runs(tmp_path, change):
    proc = subprocess.run([sys.executable, SCRIPT, f"--workdir={tmp_path}", f"--change={change}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "expected NAME:KEY=VALUE" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "code").exists()
