"""bench profile's attribution: which part of the model and which kind of op a traced op's
time belongs to.

`traced_op_seconds` records, with `jax.profiler`, every op the XLA CPU runtime executes (its
HLO module, its name, its seconds); `hlo_instructions` reads each instruction's opcode and
`op_name` metadata from the compiled module's text (`compiled_text`), and `classify` names its
part (attention, MoE experts' matmuls, MoE routing and dispatch, norms, the rest of the model
and the loss, sampling, the optimizer), its phase (forward, or backward: `transpose(` in the
name) and its kind (matmul, gather, scatter, sort, copy / transpose, dynamic slice, elementwise
and reductions); `breakdown` sums the times per call. This reads text and traces only, whatever
program made them; the programs bench profile times, and its run and tables, are
`espo_jax.bench.profile`.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from collections.abc import Callable

import jax

PARTS = ("attention", "MoE experts (matmuls)", "MoE routing and dispatch", "norms",
         "model rest and loss", "sampling", "optimizer, state updates, rest")
KINDS = ("matmul", "gather", "scatter", "sort", "copy / transpose", "dynamic slice",
         "elementwise and reductions")
_NOT_LEAVES = ("while", "conditional", "call")  # their bodies' ops are recorded themselves


# ---- the compiled HLO: each instruction's opcode and op_name ------------------------------------
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_MATMULS = ("dot", "convolution")


def _opcode(rhs: str) -> str:
    """The opcode of an HLO instruction's right-hand side `TYPE opcode(...)`."""
    if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rhs[i + 1:].strip().split("(", 1)[0].strip()
    return rhs.split(" ", 1)[-1].strip().split("(", 1)[0].strip()


def hlo_instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (opcode, op_name)} of a compiled module's text. A fusion that holds
    a matmul is reported as opcode "dot" with the matmul's op_name (YNNPACK and oneDNN fusions
    name their root, often a reshape); a fusion without metadata takes the first op_name of
    the computation it calls."""
    computations: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    raw = {}
    current = ""
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            c = _COMPUTATION.match(line)
            if c and not line.lstrip().startswith("HloModule"):
                current = c.group(1)
            continue
        rhs = m.group(2)
        name_m, calls_m = _OP_NAME.search(rhs), _CALLS.search(rhs)
        opcode = _opcode(rhs)
        args = rhs.split(opcode + "(", 1)[-1].split(")", 1)[0]
        entry = (opcode, name_m.group(1) if name_m else "", calls_m.group(1) if calls_m else "",
                 _OPERANDS.findall(args))
        raw[m.group(1)] = entry
        computations[current].append(entry[:2])
    out = {}
    for name, (opcode, op_name, calls, _) in raw.items():
        if opcode == "fusion" and calls:
            inner = computations.get(calls, [])
            dots = [n for oc, n in inner if oc in _MATMULS]
            if dots:
                opcode, op_name = "dot", dots[0] or op_name
            elif not op_name:
                op_name = next((n for _, n in inner if n), "")
        out[name] = (opcode, op_name)
    for name, (opcode, op_name) in out.items():  # still unnamed: an operand's name
        if not op_name:
            named = [out[a][1] for a in raw[name][3] if a in out and out[a][1]]
            out[name] = (opcode, named[0] if named else "")
    return out


def classify(name: str, opcode: str, op_name: str) -> tuple[str, str, str]:
    """(part, phase, kind) of one op (see the module docstring)."""
    path = op_name.lower()
    scopes = set(re.split(r"[/()]", path))  # "transpose(jvp(attn))/dot_general": attn, ...
    phase = "backward" if "transpose(" in path else "forward"
    is_matmul = opcode in _MATMULS
    if "moe" in scopes:
        part = "MoE experts (matmuls)" if is_matmul else "MoE routing and dispatch"
    elif "attn" in scopes:
        part = "attention"
    elif any(x.endswith("_norm") for x in scopes):
        part = "norms"
    elif "sampling" in scopes:
        part = "sampling"
    elif scopes & {"transformer", "log_softmax"} or "logprob" in path:
        part = "model rest and loss"
    else:
        part = "optimizer, state updates, rest"
    n = name.lower()
    if is_matmul:
        kind = "matmul"
    elif "scatter" in n or opcode == "scatter":
        kind = "scatter"
    elif "gather" in n or opcode == "gather":
        kind = "gather"
    elif "sort" in n or opcode == "sort":
        kind = "sort"
    elif "dynamic-slice" in n or "dynamic-update-slice" in n or opcode.startswith("dynamic"):
        kind = "dynamic slice"
    elif "copy" in n or "transpose" in n or opcode in ("copy", "transpose"):
        kind = "copy / transpose"
    else:
        kind = "elementwise and reductions"
    return part, phase, kind


# ---- tracing ------------------------------------------------------------------------------------
def traced_op_seconds(fn: Callable[[], object], calls: int) -> list[tuple[str, str, float]]:
    """(HLO module, HLO op, seconds) of every op the XLA CPU runtime executed during `calls`
    calls of the blocking `fn`, from a `jax.profiler` trace."""
    with tempfile.TemporaryDirectory() as logdir:
        jax.profiler.start_trace(logdir)
        try:
            for _ in range(calls):
                fn()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
        if len(paths) != 1:
            raise RuntimeError(f"expected one xplane.pb in the trace of {logdir}, got {paths}")
        data = jax.profiler.ProfileData.from_file(paths[0])
    ops = []
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                if "hlo_op" in stats:
                    ops.append((str(stats.get("hlo_module", "")), str(stats["hlo_op"]),
                                ev.duration_ns * 1e-9))
    return ops


def breakdown(ops: list[tuple[str, str, float]], modules: dict[str, str], calls: int) -> dict:
    """Thread milliseconds per call by (part, phase) and by kind. `modules`: {HLO module name:
    compiled text} of the programs to attribute; ops of other modules count as `other programs`."""
    tables = {m: hlo_instructions(text) for m, text in modules.items()}
    by_part: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    by_kind: dict[str, float] = collections.defaultdict(float)
    unattributed = other = 0.0
    for module, op, sec in ops:
        table = tables.get(module)
        if table is None:
            other += sec
            continue
        if op not in table:
            unattributed += sec
            continue
        opcode, op_name = table[op]
        if opcode in _NOT_LEAVES:
            continue
        part, phase, kind = classify(op, opcode, op_name)
        by_part[part][phase] += sec
        by_kind[kind] += sec
    ms = lambda s: 1e3 * s / calls
    total = sum(by_kind.values()) + unattributed + other
    return {
        "thread_ms_per_call": ms(total),
        "by_part_ms": {p: {ph: ms(s) for ph, s in by_part[p].items()} for p in PARTS
                       if p in by_part},
        "by_kind_ms": {k: ms(by_kind[k]) for k in KINDS if k in by_kind},
        "unattributed_ms": ms(unattributed),
        "other_programs_ms": ms(other),
    }


def compiled_text(jitted, *args, compiler_options: dict | None = None) -> tuple[str, str]:
    """(HLO module name, text) of `jitted` compiled for `args` (with XLA `compiler_options`)."""
    text = jitted.lower(*args).compile(compiler_options=compiler_options).as_text()
    name = re.search(r"HloModule\s+([\w.\-]+)", text).group(1)
    return name, text
