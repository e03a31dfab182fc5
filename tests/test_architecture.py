"""The import graph of `espo_jax/` follows the data: workers and the learner meet only at the
buffer and the published weights.

Every import statement is read from the source (function-level imports too, since a lazy import
is still a dependency), resolved to a module of the package, and checked against the rules:
models and rl know nothing of the pipeline, the buffer contract knows neither side nor JAX,
rollout and rewards never reach into train, and no two modules import each other in a circle;
the package rules hold through intermediate modules too (a worker importing config validation
must not reach the learner).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = "espo_jax"
ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX_LIBS = ("jax", "jaxlib", "flax", "optax", "orbax", "chex")

# (importer's package, forbidden target packages, why)
RULES = [
    ("models", ("train", "rollout", "buffer", "data", "rewards", "zve", "rl", "tasks",
                "run_setup", "bench"), "the model knows nothing of the pipeline"),
    ("rl", None, "losses and advantages are pure functions of arrays: rl imports only rl"),
    ("buffer", ("rollout", "train", "models", "data", "zve", "rl", "rewards", "tasks",
                "run_setup", "sharding", "distributed"),
     "the worker-learner contract imports neither side"),
    ("rollout", ("train",), "rollout never imports train"),
    ("rewards", ("train",), "rewards never import train"),
]
# packages that must not import JAX: the buffer (rollout workers start fast), and the neutral
# homes of what config validation, the workers and the learner share (choices, mesh rules)
NO_JAX = ("buffer", "choices", "mesh_rules")
# (importer, imported module): why a rule does not apply there
EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: pathlib.Path) -> dict[str, list[tuple[str, int]]]:
    """Module -> [(imported name, line)], every `import` / `from ... import` in the file."""
    modules = {module_name(root, p): p for p in (root / PACKAGE).rglob("*.py")}
    out: dict[str, list[tuple[str, int]]] = {}
    for mod, path in sorted(modules.items()):
        is_pkg = path.name == "__init__.py"
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{target}.{a.name}"
                    found.append((sub if sub in modules else target, node.lineno))
        out[mod] = found
    return out


def with_parents(mod: str, target: str, graph) -> list[str]:
    """`target` and the packages Python initialises to import it: importing espo_jax.models.x
    runs espo_jax/models/__init__.py first (unless `mod` lives inside that package). Each is
    the same package for the rules; what a package's __init__ imports matters for JAX."""
    parts = target.split(".")
    parents = [".".join(parts[:n]) for n in range(2, len(parts))]
    return [p for p in parents if p in graph and mod != p and not mod.startswith(p + ".")] + [
        target]


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(root: pathlib.Path) -> list[str]:
    graph = imports(root)
    errors = []
    for mod, found in graph.items():
        pkg = _package(mod)
        for target, line in found:
            where = f"{mod} (line {line}) imports {target}"
            top = target.split(".")[0]
            if pkg in NO_JAX and top in JAX_LIBS:
                errors.append(f"{where}: {pkg} must not import JAX")
            if top != PACKAGE or (mod, target) in EXCEPTIONS:
                continue
            tpkg = _package(target)
            for src, banned, why in RULES:
                if pkg == src and tpkg != src and (banned is None or tpkg in banned):
                    errors.append(f"{where}: {why}")
    # Transitively: nothing a NO_JAX package imports from espo_jax may import JAX either.
    for pkg in NO_JAX:
        reach = [m for m in graph if _package(m) == pkg]
        seen = set(reach)
        while reach:
            m = reach.pop()
            for imported, _ in graph.get(m, []):
                for target in with_parents(m, imported, graph):
                    if target in graph and target not in seen:
                        seen.add(target)
                        reach.append(target)
        for m in sorted(seen):
            if _package(m) != pkg and any(t.split(".")[0] in JAX_LIBS for t, _ in graph[m]):
                errors.append(f"{pkg} reaches {m}, which imports JAX")
    # Transitively too: a rollout worker validating its config reached the learner through
    # config_validation (-> train.step, for the replay modes), against the data's direction.
    for src, banned, why in RULES:
        if banned is None:
            continue
        for mod in (m for m in graph if _package(m) == src):
            via = reached(graph, mod)
            for target in sorted(via):
                if (len(via[target]) > 2 and _package(target) in banned  # direct: above
                        and _package(target) != src
                        and not any((m, target) in EXCEPTIONS for m in graph)):
                    errors.append(f"{mod} reaches {target} ({' -> '.join(via[target])}): {why}")
    errors += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return errors


def reached(graph: dict[str, list[tuple[str, int]]], start: str) -> dict[str, list[str]]:
    """Every module of the package `start` imports, directly or not, with one import chain."""
    chain = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop()
        for target, _ in graph.get(m, []):
            if target in graph and target not in chain:
                chain[target] = chain[m] + [target]
                todo.append(target)
    del chain[start]
    return chain


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    edges = {m: sorted({t for t, _ in found if t in graph and t != m})
             for m, found in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_follows_the_import_rules():
    assert violations(ROOT) == []


def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_forbidden_import_is_caught(tmp_path):
    # A copy of the real rules on a small tree: each file below breaks one rule, the last two
    # import each other (one of them inside a function).
    root = _tree(tmp_path, {
        "__init__.py": "",
        "rl/__init__.py": "", "rl/losses.py": "from espo_jax.train import step\n",
        "train/__init__.py": "", "train/step.py": "import numpy\n",
        "buffer/__init__.py": "", "buffer/records.py": "import jax.numpy as jnp\n",
        "buffer/weights.py": "from espo_jax.models import hf_io\n",
        "models/__init__.py": "", "models/hf_io.py": "import jax\n",
        "rollout/__init__.py": "",
        "rollout/worker.py": "def main():\n    from espo_jax.train import step\n",
        "rewards/__init__.py": "", "rewards/a.py": "from . import b\n",
        "rewards/b.py": "def f():\n    from espo_jax.rewards import a\n",
        "rollout/cli.py": "from espo_jax import config_validation\n",
        "config_validation.py": "from espo_jax.train.step import REPLAY_MODES\n",
    })
    errors = violations(root)
    assert "espo_jax.rl.losses (line 1) imports espo_jax.train.step: losses and advantages " \
           "are pure functions of arrays: rl imports only rl" in errors
    assert "espo_jax.buffer.records (line 1) imports jax.numpy: buffer must not import JAX" \
           in errors
    assert "espo_jax.buffer.weights (line 1) imports espo_jax.models.hf_io: the " \
           "worker-learner contract imports neither side" in errors
    assert "buffer reaches espo_jax.models.hf_io, which imports JAX" in errors
    assert "espo_jax.rollout.worker (line 2) imports espo_jax.train.step: rollout never " \
           "imports train" in errors
    assert "import cycle: espo_jax.rewards.a -> espo_jax.rewards.b" in errors
    # through a module outside the banned package: a worker validating its config
    assert ("espo_jax.rollout.cli reaches espo_jax.train.step (espo_jax.rollout.cli -> "
            "espo_jax.config_validation -> espo_jax.train.step): rollout never imports train"
            ) in errors
    assert len(errors) == 7, errors


def test_a_package_import_runs_its_init(tmp_path):
    """`from espo_jax.text.tokenizer import T` runs espo_jax/text/__init__.py first: the buffer's
    inspector reached JAX so (through espo_jax.models) while importing a JAX-free module."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "buffer/__init__.py": "", "buffer/__main__.py": "from espo_jax.text.tokenizer import T\n",
        "text/__init__.py": "import flax\n", "text/tokenizer.py": "import json\n",
    })
    assert violations(root) == ["buffer reaches espo_jax.text, which imports JAX"]
