"""Every figure the documents print from a stored result file is that file's.

The convention (stated at the top of experiments/results/README.md): in a paragraph, list item
or table of README.md, experiments/results/README.md or an experiments/*.py docstring that names
a stored file of experiments/results/, every figure comes from the files it names (a table with
no file name takes its caption's, and the paragraph after a table the table's). A figure is a
number outside code spans with a decimal point, a thousands separator, or a unit (%, x, s, ms,
k, M, GiB, GFLOP/s, tok/s). The results README's "Claims" table says how each is computed: the
figures as printed, the file, and a Python expression over the file's json `j` (with `mean`,
`std` (sample), `row` (the values, then their mean and std) and `np`) whose value, or list of
values, rounds to them; an expression that is a comparison must hold. Config values and
commands go in code spans, so they are not figures.
"""

import ast
import json
import math
import os
import re

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "experiments", "results")
RESULTS_README = os.path.join(RESULTS, "README.md")

# Names of files a run, a launcher or a benchmark writes; not stored results.
GENERIC = {"summary.json", "F.json", "config.json", "tokenizer_config.json", "progress.json",
           "loss_seeds.json", "metrics.json"}

_UNIT = r"(?:%|x|k|M| s| ms| us| GiB| MiB| GB| GFLOP/s| tok/s)"
FIGURE = re.compile(
    r"(?<![\w.])(?P<sign>[+-](?=\d))?(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<dec>\.\d+)?"
    r"(?P<exp>e-?\d+)?(?P<unit>" + _UNIT + r")?(?!\w|\.\d|/)")
FILE = re.compile(r"[\w.-]+\.(?:json|png)\b")


def numbers(text: str, figures_only: bool = True):
    """The numbers of `text` as (printed text less a plus sign, commas and unit; its value; its
    decimals). With figures_only, only those that are figures by the convention above."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"\b\d{4}-\d{2}-\d{2}\b", " ", text)
    out = []
    for m in FIGURE.finditer(text):
        if figures_only and not (m["dec"] or "," in m["int"] or m["unit"]):
            continue
        printed = (m["sign"] if m["sign"] == "-" else "") + m["int"].replace(",", "") + (
            m["dec"] or "") + (m["exp"] or "")
        decimals = len(m["dec"]) - 1 if m["dec"] else 0
        if m["exp"]:
            decimals -= int(m["exp"][1:])
        out.append((printed, float(printed), decimals))
    return out


def blocks(text: str):
    """Paragraphs, list items, headings, images and tables of a markdown text (fenced code and
    4-space-indented lines left out), each as (text, names of stored files it cites). A table
    that names no file takes the files of the block before it (its caption), and the block right
    after a table, if it names none, the table's (its reading)."""
    raw, current, fenced = [], [], False

    def close():
        if current:
            raw.append("\n".join(current))
            current.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            close()
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not current:
            close()
            continue
        table, alone = line.startswith("|"), line.startswith(("#", "!["))
        starts = (not line.strip() or alone or re.match(r"\s*(-|\d+\.) ", line)
                  or (current and table != current[-1].startswith("|")))
        if starts:
            close()
        if line.strip():
            current.append(line)
        if alone:
            close()
    close()
    out, previous, after_table = [], set(), False
    for block in raw:
        files = {f for f in FILE.findall(block) if os.path.exists(os.path.join(RESULTS, f))}
        if not files and (block.startswith("|") or after_table and block[0] not in "#!"):
            files = previous
        out.append((block, files))
        previous, after_table = files, block.startswith("|")
    return out


def split_claims(text: str):
    """The results README without its Claims section, and the section's rows as (figures,
    file, expression)."""
    head, sep, rest = text.partition("\n## Claims\n")
    assert sep, "experiments/results/README.md has a '## Claims' section"
    section, _, tail = rest.partition("\n## ")
    rows = []
    for line in section.splitlines():
        cells = [c.strip().strip("`").strip() for c in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[0] != "figures" and not re.fullmatch(r":?-+:?", cells[0]):
            rows.append(tuple(cells))
    return head + ("\n## " + tail if tail else ""), rows


def _mean(xs):
    return float(np.mean(list(xs)))


def _std(xs):
    return float(np.std(list(xs), ddof=1))


def evaluate(expression: str, name: str):
    with open(os.path.join(RESULTS, name)) as f:
        j = json.load(f)
    env = {"j": j, "np": np, "mean": _mean, "std": _std, "__builtins__": __builtins__,
           "row": lambda xs: [*(xs := list(xs)), _mean(xs), _std(xs)]}
    return eval(compile(ast.parse(expression, mode="eval"), name, "eval"), env)  # noqa: S307


def claim_error(figures: str, name: str, expression: str):
    """None when the expression's value over `name` prints as `figures`, else why not."""
    if not os.path.exists(os.path.join(RESULTS, name)):
        return f"{name}: no such stored file"
    value = evaluate(expression, name)
    printed = numbers(figures, figures_only=False)
    if isinstance(value, str):
        return None if value == figures else f"{figures}: {name} says {value!r} ({expression})"
    if isinstance(value, bool):
        return None if value else f"{figures}: {expression} is false in {name}"
    values = list(np.ravel(np.asarray(value, dtype=float)))
    if len(values) != len(printed):
        return f"{figures}: {len(printed)} figures, {expression} gives {len(values)} values"
    for (text, number, decimals), v in zip(printed, values, strict=True):
        if not math.isclose(v, number, abs_tol=0.5 * 10.0 ** -decimals * (1 + 1e-9)):
            return f"{figures}: {text} printed, {float(v)!r} in {name} ({expression})"
    return None


def uncovered(text: str, claims, where: str):
    """Figures in blocks of `text` that name stored files but have no claim on those files."""
    claimed = {}
    for figures, name, _ in claims:
        claimed.setdefault(name, set()).update(p for p, _, _ in numbers(figures, False))
    missing = []
    for block, files in blocks(text):
        have = set().union(*(claimed.get(f, set()) for f in files)) if files else set()
        for printed, _, _ in numbers(block) if files else ():
            if printed not in have:
                missing.append(f"{where}: {printed} ({', '.join(sorted(files))}): "
                               f"{block[:80]!r}")
    return missing


def unprinted(docs, claims):
    """Claims whose figures no block naming their file prints (rows left behind by an edit):
    each number of a numeric claim, the whole text of a claim that is a string (a commit, a
    date, a CPU) must appear in such a block. Comparisons are bounds, not printed values."""
    printed, texts = {}, {}
    for text in docs.values():
        for block, files in blocks(text):
            for f in files:
                printed.setdefault(f, set()).update(p for p, _, _ in numbers(block))
                texts.setdefault(f, []).append(block)
    out = []
    for figures, name, expression in claims:
        value = evaluate(expression, name)
        if isinstance(value, str):
            if not any(figures in block for block in texts.get(name, ())):
                out.append(f"{figures} ({name})")
        elif not isinstance(value, bool):
            out += [f"{p} ({name})" for p, _, _ in numbers(figures, False)
                    if p not in printed.get(name, ())]
    return out


def _documents():
    with open(os.path.join(REPO, "README.md")) as f:
        docs = {"README.md": f.read()}
    with open(RESULTS_README) as f:
        results, claims = split_claims(f.read())
    docs["experiments/results/README.md"] = results
    experiments = os.path.join(REPO, "experiments")
    for name in sorted(os.listdir(experiments)):
        if name.endswith(".py"):
            with open(os.path.join(experiments, name)) as f:
                docs[f"experiments/{name}"] = ast.get_docstring(ast.parse(f.read())) or ""
    return docs, claims


DOCS, CLAIMS = _documents()


def test_every_claim_is_its_file():
    assert len(CLAIMS) > 20
    errors = [e for row in CLAIMS if (e := claim_error(*row))]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("where", sorted(DOCS))
def test_every_figure_naming_a_stored_file_has_a_claim(where):
    missing = uncovered(DOCS[where], CLAIMS, where)
    assert not missing, "\n".join(missing)


def test_every_claim_is_printed():
    missing = unprinted(DOCS, CLAIMS)
    assert not missing, "claims nothing prints: " + ", ".join(missing)


def test_every_stored_file_is_cited_and_every_cited_file_is_stored():
    stored = {f for f in os.listdir(RESULTS) if f.endswith((".json", ".png"))}
    with open(RESULTS_README) as f:
        index = f.read()
    assert not {f for f in stored if f not in index}, "stored files the results README omits"
    cited = set().union(*(FILE.findall(text) for text in DOCS.values()))
    cited |= {name for _, name, _ in CLAIMS}
    missing = {os.path.basename(c) for c in cited} - GENERIC - stored
    assert not missing, f"cited but not stored: {sorted(missing)}"


def test_a_wrong_figure_is_caught():
    """A claim whose printed figure is off by one in its last digit fails, and a figure added
    to a block that names a stored file without a claim is reported."""
    figures, name, expression = next(c for c in CLAIMS if "." in c[0])
    assert claim_error(figures, name, expression) is None
    text, _, decimals = numbers(figures, False)[0]
    wrong = f"{float(text) + 10.0 ** -decimals:.{decimals}f}"
    assert claim_error(figures.replace(text, wrong, 1), name, expression) is not None
    assert claim_error("1 2", name, expression) is not None
    assert claim_error("0.5", name, "j is None") is not None
    assert claim_error("0123abc", "recipe_validation.json", 'j["commit"][:7]') is not None
    assert unprinted({"doc": f"`{name}`: 0.5"}, [("0.5 0.25", name, "[0.5, 0.25]")]) == [
        f"0.25 ({name})"]

    doc = f"The default gained 0.123 points (`{name}`).\n\n| a | b |\n|---|---|\n| 9.87 | x |\n"
    missing = uncovered(doc, CLAIMS, "doc")
    assert [m.split(" ")[1] for m in missing] == ["0.123", "9.87"]
    assert uncovered(doc.replace(f"`{name}`", "no file"), CLAIMS, "doc") == []


def test_figures_are_read_as_printed():
    found = numbers("0.845 +- 0.066, +16.0 points, 2.05x, 50% of 1,159,822 tokens in 434 s; "
                    "`--config.seed=3` 035ebc6 4e32d0b lr 3e-4, 9.6e-5, seeds 0-4, 1.96-2.24x.")
    assert [p for p, _, _ in found] == ["0.845", "0.066", "16.0", "2.05", "50", "1159822",
                                        "434", "9.6e-5", "1.96", "2.24"]
    assert [d for _, _, d in found][-3:] == [6, 2, 2]
