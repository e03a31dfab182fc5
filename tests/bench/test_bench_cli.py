"""`python -m espo_jax.bench NAME [--quick] [--out F.json]`: absl's usage errors, each before a
benchmark starts (a benchmark's own flags belong to it alone)."""

import subprocess
import sys

import pytest

NAMES = "model, buffer, engine, zve, attention, peers"


@pytest.mark.parametrize("args, message", [
    ([], f"give one benchmark NAME, one of {NAMES}; got none"),
    (["nope"], f"give one benchmark NAME, one of {NAMES}; got nope"),
    (["model", "--budget=5"], "--budget: not a flag of the model benchmark"),
    (["zve", "--init_from=/nonexistent/run"], "--init_from '/nonexistent/run' is not a directory"),
    (["model", "--bogus"], "Unknown command line flag 'bogus'"),
    (["model", "--quick=maybe"], "flag --quick=maybe"),
])
def test_usage_errors(args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "espo_jax.bench", *args, f"--out={tmp_path}/f"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())
