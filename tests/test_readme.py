"""The README's promises: its loss prototype runs as written, the stored files it cites exist,
and it stays a page people read."""

import contextlib
import io
import json
import os
import re

import numpy as np

from espo_jax.bench import zve_spend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md")).read()


def test_prototyping_a_loss_runs_as_written():
    section = README.split("## Prototyping a loss", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    from espo_jax.rl import losses

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})  # noqa: S102
    finally:
        losses.LOSSES.pop("reinforce", None)
    # Ratio 1, advantage 1 on the two unmasked tokens: token mean of J = 1, loss -1.
    assert out.getvalue().split() == ["-1.0", "2.0"]


def test_cited_results_files_exist_and_the_page_is_short():
    # Stored figures; the others are names of files a run, a benchmark or a checkpoint holds.
    generic = {"summary.json", "F.json", "config.json", "tokenizer_config.json",
               "progress.json"}
    cited = set(re.findall(r"[\w.-]+\.(?:json|png)\b", README)) - generic
    assert cited, "the README cites its stored figures"
    results = os.path.join(REPO, "experiments", "results")
    for name in cited:
        assert os.path.exists(os.path.join(results, os.path.basename(name))), name
    assert len(README.splitlines()) < 300


def test_ms_zve_table_is_the_stored_benchmark():
    """The README's MS-ZVE rows are `zve_bench.json`'s figures, rounded as printed."""
    with open(os.path.join(REPO, "experiments", "results", "zve_bench.json")) as f:
        configs = json.load(f)["configurations"]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in README.splitlines() if line.startswith("| ZV rate, generated")
            or line.startswith("| trained tokens with zero advantage")}
    assert len(configs) == 8 and len(rows) == 2
    rate = [f"{100 * c['zero_variance_groups'] / c['groups']:.1f}%" for c in configs.values()]
    # Stored before espo_jax.zve.accounting's names: read under them.
    configs = {k: zve_spend.current_figures(c) for k, c in configs.items()}
    zero_adv = [f"{100 * c['trained_zero_adv_tokens'] / c['trained_tokens']:.1f}%"
                for c in configs.values()]
    assert rows["ZV rate, generated groups"] == rate
    assert rows["trained tokens with zero advantage"] == zero_adv


def test_seed_table_is_the_stored_curves():
    """The README's default-experiment rows per seed are `arith_espo_seeds.json`'s first and
    last held-out accuracy of each seed's curve, with their mean and sample std as printed."""
    with open(os.path.join(REPO, "experiments", "results", "arith_espo_seeds.json")) as f:
        curves = json.load(f)["curves"]
    seeds = [f"seed{i}" for i in range(5)]
    assert sorted(curves) == seeds
    assert all(curves[s][0][0] == 0 and curves[s][-1][0] == 120 for s in seeds)
    for label, at in (("| warm start |", 0), ("| after 120 ESPO steps |", -1)):
        rows = [line for line in README.splitlines() if line.startswith(label)
                and line.count("|") == 8]
        assert len(rows) == 1, label
        values = np.array([curves[s][at][1] for s in seeds])
        cells = [c.strip().strip("*") for c in rows[0].split("|")[2:-1]]
        assert cells == [f"{v:.3f}" for v in values] + [
            f"{values.mean():.3f} +- {values.std(ddof=1):.3f}"], rows[0]


def _stored_aggregate(name):
    with open(os.path.join(REPO, "experiments", "results", name)) as f:
        return json.load(f)["aggregate"]


def _check_cells(agg, setting, loss, acc_cell, gain_cell, row):
    a = agg.get(setting, {}).get(loss)
    if a is None:
        assert acc_cell == "-", row
        return
    acc, gain = a["test_accuracy"], a["test_gain"]
    assert acc_cell == f"{acc['mean']:.3f} ({len(acc['values'])})", row
    assert gain_cell == f"{100 * gain['mean']:+.1f} +- {100 * gain['std']:.1f} pts", row


def test_loss_table_is_the_stored_comparison():
    """The README's five-loss rows (six cells: loss, then test accuracy and gain on-policy and
    off-policy, then the clip fractions) are `loss_seeds_chosen_lr.json`'s aggregates, rounded
    as printed, one row per loss."""
    agg = _stored_aggregate("loss_seeds_chosen_lr.json")
    rows = [line for line in README.splitlines() if line.startswith("| ") and " pts |" in line]
    assert len(rows) == 5, rows
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert len(cells) == 6, row
        _check_cells(agg, "on", cells[0], cells[1], cells[2], row)
        _check_cells(agg, "off", cells[0], cells[3], cells[4], row)


def test_speed_table_is_the_stored_peers_benchmark():
    """The README's three speed rows are `peers_bench.json`'s figures as printed: espo_jax's
    step time or tokens/s, the peer's, and their ratio."""
    with open(os.path.join(REPO, "experiments", "results", "peers_bench.json")) as f:
        bench = json.load(f)
    grpo, gen, train = bench["grpo_step"], bench["generation"], bench["train_step"]
    expected = {
        "| GRPO step": (f"{grpo['espo_step_s']:.3f} s", f"{grpo['trl_step_s']:.3f} s",
                        f"{grpo['espo_over_trl']:.2f}x"),
        "| generation": (f"{gen['espo_tokens_per_s']:.0f} tok/s",
                         f"{gen['hf_tokens_per_s']:.0f} tok/s", f"{gen['espo_over_hf']:.2f}x"),
        "| train step": (f"{train['jax_tokens_per_s']:.0f} tok/s",
                         f"{train['torch_tokens_per_s']:.0f} tok/s",
                         f"{train['jax_over_torch']:.2f}x")}
    for start, (ours, peer, ratio) in expected.items():
        rows = [line for line in README.splitlines() if line.startswith(start)]
        assert len(rows) == 1, (start, rows)
        cells = [c.strip() for c in rows[0].split("|")[1:-1]]
        assert cells[1] == ours and cells[2].endswith(peer) and cells[3] == ratio, rows[0]
    of_peak = train["jax_flops_per_s"] / bench["peak_matmul_flops"]
    assert f"{100 * of_peak:.0f}% of peak" in README


def test_every_module_the_docs_name_exists():
    """README.md and docs/*.md name modules by path; each one is in the repository."""
    docs = [README] + [open(os.path.join(REPO, "docs", f)).read()
                       for f in sorted(os.listdir(os.path.join(REPO, "docs")))]
    path = r"\b(?:espo_jax|experiments|launch)/[\w/]+\.(?:py|sh)\b"
    named = {p for d in docs for p in re.findall(path, d)}
    assert len(named) > 20
    missing = sorted(p for p in named if not os.path.exists(os.path.join(REPO, p)))
    assert not missing, f"the docs name modules that do not exist: {missing}"
