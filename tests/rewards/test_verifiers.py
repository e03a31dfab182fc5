"""Verifiers: exact arith check, math equivalences, timeouts (soft and hard), worker threads."""

import functools
import gc
import os
import signal
import threading
import time

import pytest

from espo_jax.rewards import verifiers
from espo_jax.rewards.verifiers import (
    arith_step_credit,
    math_verify_stats,
    verify_arith,
    verify_math,
)


def helper_pid() -> int | None:
    """Pid of this thread's helper process (None before the first isolated call)."""
    helper = verifiers._slot().helper
    return helper.proc.pid if helper is not None and helper.alive() else None


@pytest.mark.parametrize("response, answer, expected", [
    ("57+87=144,144-70=74,74+12=86#86", "86", True),
    ("4-1=3,3-7=-4#-4", "-4", True),
    ("4-1=3,3-7=-4#-4", -4, True),            # int reference
    ("1+5=6# 6 ", "6", True),                 # whitespace around the answer is ignored
    ("1+5=6#+6", "6", True),                  # explicit sign
    ("1+5=6#06", "6", True),                  # leading zero: same integer
    ("1+5=6", "6", False),                    # no '#': no committed answer
    ("1+5=7#7", "6", False),
    ("#6#7", "6", False),                     # the LAST '#' counts
    ("1+5=6#6 done", "6", False),             # trailing text
    ("1+5=6#6.0", "6", False),                # not an integer
    ("", "6", False),
])
def test_verify_arith(response, answer, expected):
    assert verify_arith(response, answer) is expected


@pytest.mark.parametrize(
    "response, credit",
    [
        ("a5=5,b+7=12,c-3=9#9", 1.0),  # every step
        ("a5=5,b+7=12,c-3=8#8", 2 / 3),  # the last step's arithmetic is wrong
        ("a5=5,b+7=11,c-3=9#9", 1 / 3),  # a later right step after a mistake earns nothing
        ("a5=5,b+7=12", 2 / 3),  # stopped before the last step, no answer
        ("a5=5,b+7=12,c-3=9,d+1=10#10", 1.0),  # an extra step: the outcome says it is wrong
        ("a6=6,b+7=13,c-3=10#10", 0.0),
        ("", 0.0),
    ],
)
def test_arith_step_credit(response, credit):
    assert arith_step_credit(response, "a5=5,b+7=12,c-3=9#9") == pytest.approx(credit)


def test_arith_step_credit_needs_a_worked_solution():
    with pytest.raises(ValueError, match="has no steps"):
        arith_step_credit("a5=5#5", "")


def test_verify_arith_rejects_bad_reference():
    with pytest.raises(ValueError, match="not an integer"):
        verify_arith("#1", "1/2")


@pytest.mark.parametrize("response, answer, expected", [
    ("The answer is 0.5", "1/2", True),
    ("so the result is \\boxed{0.5}.", "\\frac{1}{2}", True),
    ("\\boxed{\\frac12}", "0.5", True),
    ("\\boxed{\\dfrac{1}{2}} and some trailing words", "\\frac{1}{2}", True),
    ("first \\boxed{3}, then corrected: \\boxed{ 4 }", "4", True),   # last box wins
    ("first \\boxed{3}, then corrected: \\boxed{4}", "3", False),
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "72", True),        # GSM8K style
    ("#### 1,000", "1000", True),
    ("\\boxed{\\frac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}", True),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", True),
    ("\\boxed{\\{1, 2\\}}", "\\{2,1\\}", True),                      # sets ignore order
    ("\\boxed{0.33}", "\\frac{1}{3}", False),
    ("I have no idea", "5", False),
])
def test_verify_math_equivalences(response, answer, expected):
    assert verify_math(response, answer, timeout_s=5.0) is expected


def test_soft_timeout_keeps_the_helper():
    verify_math("\\boxed{1}", "1")  # make sure this thread's helper is up
    pid, before = helper_pid(), math_verify_stats()
    start = time.monotonic()
    # expanding (x+1)^2000 in sympy takes many seconds; the helper's alarm stops it at 0.3 s
    assert verify_math("\\boxed{(x+1)^{2000}-x^{2000}}", "1", timeout_s=0.3) is False
    assert time.monotonic() - start < 0.3 + verifiers._HARD_GRACE_S
    after = math_verify_stats()
    assert after["timeouts"] == before["timeouts"] + 1
    assert after["helper_restarts"] == before["helper_restarts"]
    assert helper_pid() == pid


def test_hard_timeout_kills_and_replaces_a_stuck_helper():
    verify_math("\\boxed{1}", "1")
    pid, before = helper_pid(), math_verify_stats()
    os.kill(pid, signal.SIGSTOP)  # a helper that ignores its own alarm (like a long C call)
    start = time.monotonic()
    assert verify_math("\\boxed{2}", "2", timeout_s=0.3) is False
    elapsed = time.monotonic() - start
    assert 0.3 + verifiers._HARD_GRACE_S - 0.05 < elapsed < 0.3 + verifiers._HARD_GRACE_S + 2.0
    after = math_verify_stats()
    assert after["helper_restarts"] == before["helper_restarts"] + 1
    assert after["timeouts"] == before["timeouts"] + 1
    assert verify_math("\\boxed{2}", "2") is True  # a fresh helper answers
    assert helper_pid() not in (None, pid)
    with pytest.raises(ProcessLookupError):  # the stuck one is gone (killed and reaped)
        os.kill(pid, 0)


def test_works_off_the_main_thread():
    cases = [("\\boxed{0.5}", "1/2", True), ("#### 7", "8", False)]
    results, errors = {}, []

    def worker(i, response, answer):
        try:
            results[i] = (verify_math(response, answer, timeout_s=5.0), helper_pid())
        except Exception as e:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, *c[:2])) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[i][0] for i in range(2)] == [c[2] for c in cases]
    pids = {results[i][1] for i in range(2)}
    assert len(pids) == 2 and helper_pid() not in pids  # one helper per thread
    gc.collect()
    for pid in pids:  # a finished thread's helper is stopped with it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_deadline_survives_a_swallowed_alarm():
    from espo_jax.rewards.verifiers import _deadline, _Timeout

    start = time.monotonic()
    with pytest.raises(_Timeout), _deadline(0.1):
        try:
            time.sleep(2.0)  # the first alarm lands here...
        except _Timeout:
            pass  # ...and is dropped, as a gc callback drops it (JAX's did, in CI)
        time.sleep(2.0)  # a one-shot alarm would leave this to run its 2 s
    assert time.monotonic() - start < 0.5  # 0.1 s deadline + one 0.05 s repeat
    with _deadline(0.1):  # a block that ends in time is not interrupted
        time.sleep(0.01)
    time.sleep(0.3)  # nor later: the alarm is off once the block has ended


def test_in_process_mode_is_main_thread_only():
    assert verify_math("\\boxed{0.5}", "1/2", isolate=False) is True
    start = time.monotonic()
    assert verify_math("\\boxed{(x+1)^{2000}-x^{2000}}", "1", timeout_s=0.3,
                       isolate=False) is False
    assert time.monotonic() - start < 1.0
    errors = []

    def worker():
        try:
            verify_math("\\boxed{1}", "1", isolate=False)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors and "main thread" in errors[0]


def test_bad_timeout_is_named():
    with pytest.raises(ValueError, match="timeout_s"):
        verify_math("\\boxed{1}", "1", timeout_s=0)


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_inside_the_reward_pool(backend):
    """The reward pool's workers (forkserver processes or threads) run verify_math as is."""
    from espo_jax.rewards.pool import RewardPool

    reward_fn = functools.partial(verify_math, timeout_s=5.0)
    with RewardPool(reward_fn, num_workers=1, backend=backend, timeout_s=60.0) as pool:
        pool.submit("g", 0, "so \\boxed{\\frac{1}{2}}", "0.5")
        pool.submit("g", 1, "#### 3", "4")
        results = pool.wait_group("g", 2, timeout=60.0)
    assert [r.outcome for r in results] == [True, False]
    assert not any(r.failed for r in results)
