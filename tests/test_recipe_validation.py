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


def _report(tmp_path, *args):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "commit.txt").write_text("abc\n")
    proc = subprocess.run([sys.executable, SCRIPT, f"--workdir={tmp_path}", "--report_only",
                           *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started" not in proc.stdout
    return json.loads((tmp_path / "recipe_validation.json").read_text()), proc.stdout


def test_report_only_names_each_change_and_its_validation_curve(tmp_path):
    """Finished runs are reported with their change and curve, a missing one is left out, and
    nothing is started (a run that started would fail: there is no warm start)."""
    _finished(str(tmp_path / "seed0" / "recipe"), 0.5, [(0, 0.5), (2, 0.6), (3, 0.7)])
    _finished(str(tmp_path / "seed0" / "anchor0.5"), 0.5, [(0, 0.5), (2, 0.55), (3, 0.65)])
    result, _ = _report(tmp_path)
    assert result["commit"] == "abc" and result["cpu"].endswith("AVX-512")
    assert result["seeds"] == [0]
    assert list(result["runs"]) == ["recipe", "anchor0.5"]  # prompts16, credit_zero: not run
    assert result["runs"]["recipe"]["change"] == []
    assert "minus_recipe" not in result["runs"]["recipe"]
    anchor = result["runs"]["anchor0.5"]
    assert anchor["change"] == ["train.anchor_coef=0.5"]
    assert anchor["validation_accuracy"] == {"0": pytest.approx(0.65)}
    assert anchor["validation_curve"] == {"0": [[0, 0.5], [2, 0.55], [3, 0.65]]}
    assert anchor["minus_recipe"] == {"0": pytest.approx(-0.05)}
    assert (tmp_path / "recipe_validation.png").stat().st_size > 0


def test_a_change_of_several_settings_is_one_run(tmp_path):
    _finished(str(tmp_path / "seed0" / "recipe"), 0.5, [(0, 0.5), (3, 0.7)])
    _finished(str(tmp_path / "seed0" / "unpacked"), 0.5, [(0, 0.5), (3, 0.6)])
    result, out = _report(tmp_path, "--change=unpacked:train.pack=False,train.share_prompts=False")
    assert result["runs"]["unpacked"]["change"] == ["train.pack=False", "train.share_prompts=False"]
    assert result["runs"]["unpacked"]["minus_recipe"] == {"0": pytest.approx(-0.1)}
    assert "train.pack=False train.share_prompts=False" in out


def test_seeds_give_mean_std_and_paired_differences_on_the_seeds_both_finished(tmp_path):
    """Recipe on seeds 0 and 1, the change on 0 and 2 (its seed 1 still running): means and
    sample std over each run's own seeds; the difference to the recipe only where both ran."""
    for seed, acc in ((0, 0.8), (1, 0.9)):
        _finished(str(tmp_path / f"seed{seed}" / "recipe"), 0.6, [(0, 0.6), (3, acc)])
    for seed, acc in ((0, 0.7), (2, 0.76)):
        _finished(str(tmp_path / f"seed{seed}" / "prompts16"), 0.6, [(0, 0.6), (3, acc)])
    result, out = _report(tmp_path, "--seeds=0,1,2")
    assert result["seeds"] == [0, 1, 2]
    recipe, p16 = result["runs"]["recipe"], result["runs"]["prompts16"]
    assert recipe["over_seeds"]["mean"] == pytest.approx(0.85)
    assert recipe["over_seeds"]["std"] == pytest.approx(0.1 / 2 ** 0.5)  # sample std of 2
    assert p16["validation_accuracy"] == {"0": pytest.approx(0.7), "2": pytest.approx(0.76)}
    assert p16["over_seeds"]["mean"] == pytest.approx(0.73)
    assert p16["minus_recipe"] == {"0": pytest.approx(-0.1)}
    assert p16["minus_recipe_over_seeds"]["mean"] == pytest.approx(-0.1)
    assert "vs recipe -0.100" in out


@pytest.mark.parametrize("change", ["anchor", "x:train.anchor_coef", "recipe:optim.lr=1e-4",
                                    "x:train.pack=False,train.share_prompts", "x:a=1,=2"])
def test_a_malformed_change_is_refused_before_anything_runs(tmp_path, change):
    proc = subprocess.run([sys.executable, SCRIPT, f"--workdir={tmp_path}", f"--change={change}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "expected NAME:KEY=VALUE" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "code").exists()


@pytest.mark.parametrize("args, message", [
    (["--seeds=0,0"], "expected distinct integers"),
    (["--seeds=a"], "expected distinct integers"),
    (["--seeds=0,1", "--init_from=/w/warmstart"], "has no '{seed}'")])
def test_bad_seeds_are_refused_before_anything_runs(tmp_path, args, message):
    proc = subprocess.run([sys.executable, SCRIPT, f"--workdir={tmp_path}", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "code").exists()
