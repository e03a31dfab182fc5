"""Verifiers: the binary outcome of one response (right or wrong), nothing else.

Shaped rewards (length terms, tie-breaking) live in `espo_jax.rewards.shaping` and never feed
back into the outcome: zero-variance filtering and the correctness tier use the outcome only.

- `verify_arith(response, answer)`: the arith_chains response format is
  `"<steps>#<answer>"`; the answer is what follows the LAST `#`, surrounding whitespace
  ignored, and it must be a whole integer (`[+-]?digits`) equal to `answer`. Text after the
  number ("#12 done"), a missing `#`, or several numbers make it wrong: the format is part of
  the task, and a lenient check would reward answers the model did not commit to.
- `arith_step_credit(response, solution)`: partial credit in [0, 1], the fraction of the worked
  `solution`'s steps (comma-separated, before the `#`) that the response reproduces exactly as
  a prefix. It is a score for shaping inside the wrong tier (`espo_jax.rewards.shaping`), never
  an outcome.
- `verify_math(response, answer, timeout_s)`: equivalence by `math-verify` (fractions vs
  decimals, `\\boxed{}`, LaTeX, sets, ...). The answer is the content of the last `\\boxed{}`,
  else the text after the last `####` (GSM8K), else math-verify's own extraction from the
  whole response.

Timeouts. math-verify's own timeout uses `signal.alarm`, which works only on a process's main
thread and cannot interrupt a long C-level computation (sympy evaluating `2^{2^{40}}` sits in
one big-integer power for minutes). So `verify_math` runs the check in a helper subprocess
(one per calling thread, started once, fed over a pipe): inside it a `setitimer` alarm stops
Python-level work after `timeout_s`, and if that does not come back the caller kills the helper
after `timeout_s + _HARD_GRACE_S` and starts a new one at the next call. Either way the result
is False (and `math_verify_stats()["timeouts"]` counts it). This works the same on the main
thread, in worker threads and in worker processes (subprocess.Popen, unlike multiprocessing,
is allowed inside daemonic pool workers). `verify_math(..., isolate=False)` checks in-process
with the alarm only: for callers that are themselves killable (e.g. the reward pool's process
backend); it must be called on the main thread.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

_INT_RE = re.compile(r"[+-]?\d+")
_HARD_GRACE_S = 1.0  # extra wait for the helper's own alarm before the helper is killed
_STARTUP_TIMEOUT_S = 120.0  # importing sympy + math-verify; a loaded machine can be slow


def verify_arith(response: str, answer: str | int) -> bool:
    """True iff the integer after the last `#` of `response` equals `answer` (see module doc)."""
    expected = str(answer).strip()
    if not _INT_RE.fullmatch(expected):
        raise ValueError(f"verify_arith: reference answer {answer!r} is not an integer")
    if "#" not in response:
        return False
    given = response.rsplit("#", 1)[1].strip()
    return bool(_INT_RE.fullmatch(given)) and int(given) == int(expected)


def arith_step_credit(response: str, solution: str) -> float:
    """Leading steps of `response` equal to those of the worked `solution`, over the solution's
    step count: "a5=5,b+7=12,c-3=9#9" against a response "a5=5,b+7=11,..." scores 1/3."""
    reference = solution.split("#", 1)[0].split(",")
    if not reference[0]:
        raise ValueError(f"arith_step_credit: reference solution {solution!r} has no steps")
    given = response.split("#", 1)[0].split(",")
    matched = 0
    for ref, got in zip(reference, given, strict=False):
        if ref != got.strip():
            break
        matched += 1
    return matched / len(reference)


# ---------------------------------------------------------------------------------------------
# math


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that math-verify's `except Exception` blocks
    do not swallow it and go on computing."""


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces allowed), stripped;
    None when there is none or its braces do not balance."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def _answer_text(response: str) -> str:
    boxed = last_boxed(response)
    if boxed is not None:
        return f"${boxed}$"
    if "####" in response:
        return f"${response.rsplit('####', 1)[1].strip().replace(',', '')}$"
    return response


_REALARM_S = 0.05  # after the deadline, the alarm repeats this often until it is heard


@contextlib.contextmanager
def _deadline(timeout_s: float):
    """Raises `_Timeout` in the main thread once `timeout_s` has passed. The alarm repeats
    every `_REALARM_S` until the block ends: a handler's exception raised inside code that
    swallows exceptions (a gc callback, e.g. JAX's, prints and drops it) would otherwise be lost
    and the computation run on unbounded."""
    live = True

    def on_alarm(signum, frame):
        if live:
            raise _Timeout

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s, _REALARM_S)
    try:
        try:
            yield
        finally:
            live = False  # from here a late alarm is ignored
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)


def _check_in_process(response: str, answer: str, timeout_s: float) -> tuple[bool, bool]:
    """(outcome, timed_out); main thread only (uses SIGALRM)."""
    from math_verify import parse, verify

    try:
        with _deadline(timeout_s):
            gold = parse(f"${answer}$", parsing_timeout=None)
            pred = parse(_answer_text(response), parsing_timeout=None)
            if not gold or not pred:
                return False, False
            return bool(verify(gold, pred, timeout_seconds=None)), False
    except _Timeout:
        return False, True


class _Helper:
    """A subprocess that answers one JSON request per line: [response, answer, timeout_s]."""

    def __init__(self):
        # -P: the script's directory (espo_jax/rewards) must not shadow stdlib modules.
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-u", os.path.abspath(__file__), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer = b""
        if self._read_line(_STARTUP_TIMEOUT_S) != "ready":
            self.close()
            raise RuntimeError("verify_math: the math-verify helper process did not start")

    def _read_line(self, timeout_s: float) -> str | None:
        """One line from the helper, or None if none is complete within timeout_s."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # helper died
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()

    def check(self, response: str, answer: str, timeout_s: float) -> tuple[bool, bool] | None:
        """(outcome, timed_out), or None when the helper hung or died (then it is killed)."""
        try:
            self.proc.stdin.write(json.dumps([response, answer, timeout_s]).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            return None
        line = self._read_line(timeout_s + _HARD_GRACE_S)
        if line is None:
            self.close()
            return None
        outcome, timed_out = json.loads(line)
        return bool(outcome), bool(timed_out)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class _Slot:
    """Holds one thread's helper; when the thread ends, its thread-local slot is collected and
    the helper process is stopped with it."""

    registry: list[_Helper] = []  # every live helper of this process, for `close_helpers`

    def __init__(self):
        self.helper: _Helper | None = None

    def __del__(self):
        # Only attributes here: at interpreter exit module globals may already be gone.
        if self.helper is not None:
            self.helper.close()
            if self.helper in self.registry:
                self.registry.remove(self.helper)


def _drop(helper: _Helper) -> None:
    if helper in _helpers:
        _helpers.remove(helper)
    helper.close()


_local = threading.local()
_helpers = _Slot.registry
_stats_lock = threading.Lock()
_stats = {"calls": 0, "timeouts": 0, "helper_restarts": 0}


def _count(key: str) -> None:
    with _stats_lock:
        _stats[key] += 1


def math_verify_stats() -> dict[str, int]:
    """Process-wide counters: calls, timeouts (soft and hard), helper_restarts (hard kills)."""
    with _stats_lock:
        return dict(_stats)


def _slot() -> _Slot:
    if not hasattr(_local, "slot"):
        _local.slot = _Slot()
    return _local.slot


@atexit.register
def close_helpers() -> None:
    """Stops every helper process this process started (also run at exit)."""
    while _helpers:
        _helpers.pop().close()


def verify_math(response: str, answer: str, timeout_s: float = 5.0, *,
                isolate: bool = True) -> bool:
    """True iff the response's final answer is mathematically equal to `answer`.

    Returns False (never raises) on a timeout, an unparsable answer, or a dead helper.
    """
    if timeout_s <= 0:
        raise ValueError(f"verify_math: timeout_s must be > 0, got {timeout_s}")
    _count("calls")
    if not isolate:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("verify_math(isolate=False) uses SIGALRM and must run on the "
                               "main thread; use isolate=True in worker threads")
        outcome, timed_out = _check_in_process(response, answer, timeout_s)
    else:
        slot = _slot()
        if slot.helper is None or not slot.helper.alive():
            if slot.helper is not None:
                _drop(slot.helper)
            slot.helper = _Helper()
            _helpers.append(slot.helper)
        result = slot.helper.check(response, answer, timeout_s)
        if result is None:  # hard timeout: helper killed, a fresh one starts next call
            _count("helper_restarts")
            _drop(slot.helper)
            slot.helper = None
            result = (False, True)
        outcome, timed_out = result
    if timed_out:
        _count("timeouts")
    return outcome


def _serve() -> None:
    """Helper process main loop: one JSON request per stdin line, one reply per stdout line."""
    import logging

    logging.disable(logging.WARNING)  # math-verify logs every failed parse
    import math_verify  # noqa: F401  (import once, before announcing readiness)

    print("ready", flush=True)
    for line in sys.stdin:
        response, answer, timeout_s = json.loads(line)
        try:
            result = _check_in_process(response, answer, timeout_s)
        except Exception:  # a math-verify bug must not kill the helper: count it as wrong
            result = (False, False)
        print(json.dumps(result), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
