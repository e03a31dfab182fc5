"""`bench aot`: TPU slice names, and the tiny MoE's learner update compiled for a v5e:2x2
slice by the TPU compiler on this CPU host, through the command a user runs."""

import json
import os
import subprocess
import sys

import pytest

from espo_jax.bench.aot import HBM, parse_topology
from espo_jax.cli_errors import CommandLineError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_topology_names():
    assert parse_topology("v5p:2x2x4") == ("v5p", "v5p:2x2x4", 16)
    # Cloud TPU names count TensorCores for v5p (2 a chip), chips for v5e / v6e
    assert parse_topology("v5p-32") == ("v5p", "v5p:2x2x4", 16)
    assert parse_topology("v5p-512") == ("v5p", "v5p:4x8x8", 256)
    assert parse_topology("v6e-8") == ("v6e", "v6e:2x4", 8)
    for bad in ("v5p-48", "v7:2x2", "tpu"):
        with pytest.raises(CommandLineError, match="topology"):
            parse_topology(bad)


def test_tiny_moe_update_compiles_for_a_tpu_slice(tmp_path):
    pytest.importorskip("libtpu", reason="the TPU compiler: pip install -e '.[tpu]'")
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "espo_jax.bench", "aot", "--config",
         "experiments/qwen3_30b_a3b.py:small,devices=4,expert=4", "--topology", "v5e:2x2",
         "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["topology"], got["chips"], got["hbm_bytes"]) == ("v5e:2x2", 4, HBM["v5e"])
    assert got["master_dtype"] == "float32" and got["layers_compiled"] == got["n_layers"] == 2
    assert got["commit"] and got["libtpu"]
    assert "AVX-512" in got["host_cpu"] and got["host_peak_rss_kb"] > 100_000  # JAX alone: more
    lr = got["learner"]
    assert lr["peak_bytes"] == (lr["argument_bytes"] + lr["output_bytes"] + lr["temp_bytes"]
                                - lr["alias_bytes"]) > 0
    # a device's 4 x 55 tokens are exchanged in 14 chunks (`ep_chunk` 16), a loop whose body
    # holds one exchange there and back: the forward's, and the backward's recomputed one and
    # its transpose, 2 + 2 + 2 ragged all-to-alls (the layer remat's re-run of the loop is dead:
    # the backward needs only each chunk's inputs). The two MoE layers are one scanned run
    # (`model.scan_layers`), so the program holds that layer once: 6, not 2 x 6.
    assert lr["collectives"]["ragged-all-to-all"] == 6
    assert lr["flops_per_token"] > 0 and lr["fits"]
    en = got["engine"]
    # the small variant's 16 slots of 32 prompt + 24 new tokens, fp8 weights
    assert (en["slots"], en["context"], en["precision"]) == (16, 32 + 24, "fp8") and en["fits"]
    assert en["peak_bytes"] == (en["argument_bytes"] + en["output_bytes"] + en["temp_bytes"]
                                - en["alias_bytes"]) > 0
    assert "learner peak" in proc.stdout and "engine peak" in proc.stdout
