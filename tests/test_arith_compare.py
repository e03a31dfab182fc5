"""`launch/arith_compare.py`'s arithmetic: the SFT-only budget, the table, the plot, and the
resume rule (a finished run is not run again)."""

import importlib.util
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "arith_compare", os.path.join(REPO, "launch", "arith_compare.py"))
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def _summary(final, per_level, warm=0.5, **kw):
    s = {"warmstart_accuracy": warm, "final_accuracy": final,
         "no_signal_token_frac_with_offline": 0.1, "mean_abs_logp_mismatch": 0.005,
         "rl_seconds": 450.0, "warmstart_seconds": 300.0,
         "warmstart_steps": 600,
         "warmstart": {"eval/accuracy": warm, "eval/accuracy_level1": 0.9,
                       "eval/accuracy_level2": 0.1},
         "final": {"eval/accuracy": final, "eval/mean_response_len": 20.0,
                   **{f"eval/accuracy_level{i + 1}": v for i, v in enumerate(per_level)}}}
    s.update(kw)
    return s


def test_sft_only_gets_espo_wall_time():
    flags = compare.sft_flags(_summary(0.6, [1.0, 0.2]))
    # budget 300 + 450 = 750 s at 300 / 600 = 0.5 s per step -> 1500 steps, eval every 250
    assert flags == ["--config.train.steps=0", "--config.warmstart.steps=1500",
                     "--config.warmstart.target_accuracy=2.0",
                     "--config.warmstart.max_seconds=750", "--config.warmstart.eval_every=250"]


def test_table_and_plot(tmp_path):
    runs = {"espo": _summary(0.7, [0.95, 0.45]), "grpo": _summary(0.55, [0.9, 0.2]),
            "sft_only": _summary(0.5, [1.0, 0.0])}
    text = compare.table(runs)
    lines = text.splitlines()
    assert lines[0].startswith("| run | final acc | vs warm start | L1 | L2 |")
    assert lines[2].startswith("| warm start (shared) | 0.500 | - | 0.90 | 0.10 |")
    assert "| espo | 0.700 | +20.0 pts | 0.95 | 0.45 | 0.100 | 0.0050 | 450 | 300 |" in text
    assert "| grpo | 0.550 | +5.0 pts | 0.90 | 0.20 | 0.100 | 0.0050 | 450 | shared |" in text
    assert "| sft_only | 0.500 | +0.0 pts | 1.00 | 0.00 | - | - | - | 300 |" in text
    compare.plot(runs, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_finished_run_is_not_run_again(tmp_path):
    (tmp_path / "grpo").mkdir()
    done = _summary(0.55, [0.9, 0.2])
    (tmp_path / "grpo" / "summary.json").write_text(json.dumps(done))
    # an experiment that does not exist: running it would fail
    assert compare.run_main(str(tmp_path), "grpo", "no_such_experiment", []) == done


def test_command_line_usage_errors(tmp_path):
    script = os.path.join(REPO, "launch", "arith_compare.py")
    run = lambda *a: subprocess.run([sys.executable, script, *a], capture_output=True,
                                    text=True, timeout=60, cwd=tmp_path)
    for args, message in ((["--jobs=2"], "Flag --workdir must have a value other than None"),
                          (["--workdir", str(tmp_path), "--flags=x"],
                           "Unknown command line flag 'flags'")):
        proc = run(*args)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []  # nothing run
