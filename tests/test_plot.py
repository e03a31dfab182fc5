"""`espo_jax.plot`: PNG curves from a run's metrics.jsonl (hand-made here, in the format the
loop writes; tests/test_experiments.py also plots a real run)."""

import json
import os
import subprocess
import sys

import pytest

from espo_jax import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(workdir, with_clipping=True):
    recs = [
        {"step": 10, "phase": "warmstart", "sft/nll": 1.0, "eval/accuracy": 0.5},
        {"step": 0, "phase": "eval", "eval/accuracy": 0.25, "eval/accuracy_level1": 0.5,
         "eval/accuracy_level2": 0.0, "eval/pass_at_k": 0.5},
    ]
    for step in (1, 2, 3, 2, 3, 4):  # steps 2 and 3 again: a run resumed from checkpoint 1
        r = {"step": step, "phase": "rl", "rollout/accuracy": 0.1 * step,
             "rollout/reward_mean": 0.1 * step, "zve/zero_variance_frac_before": 0.8,
             "zve/zero_variance_frac_after_filter": 0.2, "zve/no_signal_token_frac": 0.5,
             "mismatch/logp_abs_mean": 0.004, "mismatch/kl_k3": None,  # non-finite -> null
             "moe/routing_flip_rate": 0.01, "entropy/mean": 1.5 - 0.1 * step}
        if with_clipping:  # the off-policy topics: clip fractions, ratio tails, ESPO's eps
            r.update({"pg/clipfrac_low": 0.01, "pg/clipfrac_high": 0.02,
                      "is_ratio/p01": 0.9, "is_ratio/p99": 1.1, "espo/eps_mean": 4e-4})
        recs.append(r)
    recs.append({"step": 4, "phase": "eval", "eval/accuracy": 0.5, "eval/accuracy_level1": 0.75,
                 "eval/accuracy_level2": 0.25, "eval/pass_at_k": 0.75})
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return recs


def test_series_later_record_of_a_step_wins_and_warmstart_is_left_out(tmp_path):
    recs = _write_run(tmp_path)
    # Records: warmstart, eval 0, rl 1, rl 2, rl 3, rl 2 (again), rl 3 (again), rl 4, eval 4.
    recs[4]["rollout/accuracy"] = 0.66  # the first record of step 3: superseded
    recs[6]["rollout/accuracy"] = 0.77  # the record of step 3 after the resume
    acc = plot.series(recs, "rollout/accuracy")["rollout/accuracy"]
    assert [s for s, _ in acc] == [1, 2, 3, 4]
    assert dict(acc)[3] == 0.77 and dict(acc)[4] == pytest.approx(0.4)
    ev = plot.series(recs, "eval/accuracy")["eval/accuracy"]
    assert ev == [(0, 0.25), (4, 0.5)]  # the warm-start record (step 10, 0.5) is not RL
    levels = plot.series(recs, "eval/accuracy_level*")
    assert levels == {"eval/accuracy_level1": [(0, 0.5), (4, 0.75)],
                      "eval/accuracy_level2": [(0, 0.0), (4, 0.25)]}
    assert plot.series(recs, "mismatch/kl_k3") == {}  # only nulls


def test_plot_run_writes_pngs(tmp_path):
    _write_run(tmp_path)
    written = plot.plot_run(str(tmp_path))
    names = sorted(os.path.basename(p) for p in written)
    assert names == sorted(f"{t}.png" for t in plot.TOPICS)
    for path in written:
        assert os.path.dirname(path) == str(tmp_path / "plots")
        with open(path, "rb") as f:
            data = f.read()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, path


def test_topics_without_data_are_skipped_and_torn_lines_reported(tmp_path, capsys):
    _write_run(tmp_path, with_clipping=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "phase": "rl", "rollout/acc')  # killed mid-write
    written = plot.plot_run(str(tmp_path), str(tmp_path / "out"))
    off_policy = {"clipping.png", "ratio.png", "espo_eps.png"}
    assert not off_policy & {os.path.basename(p) for p in written}
    assert len(written) == len(plot.TOPICS) - len(off_policy)
    assert "metrics.jsonl:10: skipping a malformed line" in capsys.readouterr().err


def test_plot_run_missing_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        plot.plot_run(str(tmp_path))


def test_cli(tmp_path):
    _write_run(tmp_path)
    run = lambda *a: subprocess.run([sys.executable, "-m", "espo_jax.plot", *a],
                                    capture_output=True, text=True, timeout=120)
    ok = run(str(tmp_path), "--out", str(tmp_path / "pngs"))
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.split()) == sorted(str(tmp_path / "pngs" / f"{t}.png")
                                               for t in plot.TOPICS)
    missing = run(str(tmp_path / "nope"))
    assert missing.returncode == 2 and "metrics.jsonl not found" in missing.stderr
    for bad, message in (([], "give one WORKDIR; got none"),  # absl usage errors: exit 1
                         ([str(tmp_path), "--bogus"], "Unknown command line flag 'bogus'")):
        usage = run(*bad)
        assert usage.returncode == 1 and message in usage.stderr, usage.stderr


def test_compare_runs_one_figure_and_its_curves(tmp_path):
    """Two runs' held-out accuracy in one PNG; the JSON beside it holds exactly the curves
    drawn (the later record of a resumed step wins, the warm start's records are left out)."""
    _write_run(tmp_path / "a")
    _write_run(tmp_path / "b")
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 8, "phase": "eval", "eval/accuracy": 0.75}) + "\n")
    out = tmp_path / "fig" / "cmp.png"
    run = lambda *a: subprocess.run([sys.executable, "-m", "espo_jax.plot", *a],
                                    capture_output=True, text=True, timeout=120)
    ok = run("--compare", "--out", str(out), f"sync={tmp_path / 'a'}", f"async={tmp_path / 'b'}")
    assert ok.returncode == 0, ok.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
    stored = json.loads(out.with_suffix(".json").read_text())
    assert stored["metric"] == "eval/accuracy"
    assert stored["curves"] == {"sync": [[0, 0.25], [4, 0.5]],
                                "async": [[0, 0.25], [4, 0.5], [8, 0.75]]}
    bad = run("--compare", "--out", str(out), f"x={tmp_path / 'a'}", "--metric=eval/nope")
    assert bad.returncode == 2 and "has no 'eval/nope' records" in bad.stderr
    usage = run("--compare", f"x={tmp_path / 'a'}")
    assert usage.returncode == 1 and "--compare needs --out FILE.png" in usage.stderr
