"""The README's promises: its loss prototype runs as written, the stored files it cites exist,
and it stays a page people read."""

import contextlib
import io
import os
import re

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
