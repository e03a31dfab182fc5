"""RewardPool with real worker processes and threads: scoring, failures, timeouts, overlap.

The reward functions live in `tests/helpers/reward_pool_fns.py` (no heavy imports) so process
workers that import them by name start fast.
"""

import multiprocessing
import time

import pytest
from helpers.reward_pool_fns import decode_until_zero, exact_match, sleepy

from espo_jax.rewards import pool as pool_lib


@pytest.fixture(scope="module")
def pool():
    with pool_lib.RewardPool(exact_match, num_workers=2, timeout_s=1.0) as p:
        yield p


def test_scores_in_index_order(pool):
    for i, text in enumerate(["42", "41", "shaped"]):
        pool.submit("g0", i, text, "42")
    out = pool.wait_group("g0", 3, timeout=30)
    assert [r.response_idx for r in out] == [0, 1, 2]
    assert [(r.reward, r.outcome) for r in out] == [(1.0, True), (0.0, False), (0.25, False)]
    assert out[2].components == {"length": 6.0}
    assert not any(r.failed for r in out)


def test_raising_and_bad_return_are_failed_rewards(pool):
    before = pool.metrics()
    pool.submit("g1", 0, "raise", "x")
    pool.submit("g1", 1, "string", "x")
    pool.submit("g1", 2, "x", "x")
    out = pool.wait_group("g1", 3, timeout=30)
    assert out[0].failed and "ValueError: bad response" in out[0].error
    assert out[1].failed and "TypeError" in out[1].error and "str" in out[1].error
    assert (out[0].reward, out[0].outcome) == (0.0, False)
    assert not out[2].failed and out[2].outcome
    after = pool.metrics()
    assert after["reward/errors"] - before["reward/errors"] == 2
    assert after["reward/failed"] - before["reward/failed"] == 2
    assert after["reward/worker_restarts"] == before["reward/worker_restarts"]  # not needed


@pytest.mark.parametrize("hang", ["hang", "spin"])
def test_hang_times_out_and_the_worker_is_replaced(pool, hang):
    before = pool.metrics()
    start = time.monotonic()
    pool.submit(f"g-{hang}", 0, hang, "a")
    pool.submit(f"g-{hang}", 1, "a", "a")
    out = pool.wait_group(f"g-{hang}", 2, timeout=30)
    elapsed = time.monotonic() - start
    assert out[0].failed and out[0].timed_out and "exceeded 1.0 s" in out[0].error
    assert not out[1].failed and out[1].outcome  # the other worker went on scoring
    assert 1.0 <= elapsed < 15.0  # the 120 s sleep / endless loop was cut at the 1 s timeout
    after = pool.metrics()
    assert after["reward/timeouts"] - before["reward/timeouts"] == 1
    assert after["reward/worker_restarts"] - before["reward/worker_restarts"] == 1
    # The replacement worker scores new work.
    pool.submit(f"g-{hang}-after", 0, "b", "b")
    assert pool.wait_group(f"g-{hang}-after", 1, timeout=30)[0].outcome


def test_worker_death_is_a_failed_reward(pool):
    pool.submit("g-exit", 0, "exit", "a")
    out = pool.wait_group("g-exit", 1, timeout=30)[0]
    assert out.failed and "WorkerDied" in out.error
    pool.submit("g-exit", 0, "a", "a")  # collected, so the same key may be submitted again
    assert pool.wait_group("g-exit", 1, timeout=30)[0].outcome


def test_duplicate_submission_is_rejected(pool):
    pool.submit("g-dup", 0, "a", "a")
    with pytest.raises(ValueError, match="submitted twice"):
        pool.submit("g-dup", 0, "a", "a")
    pool.wait_group("g-dup", 1, timeout=30)


def test_tokens_are_detokenized_in_the_workers():
    with pool_lib.RewardPool(exact_match, num_workers=1, detokenize=decode_until_zero) as p:
        p.submit(7, 0, [1, 2, 0, 5], "12")  # decoding stops at 0
        p.submit(7, 1, [1, 3], "12")
        assert [r.outcome for r in p.wait_group(7, 2, timeout=30)] == [True, False]
    with pool_lib.RewardPool(exact_match, num_workers=1, backend="thread") as p:
        p.submit(8, 0, [1, 2], "12")  # tokens but no detokenize: a failed reward that says so
        assert "no detokenize" in p.wait_group(8, 1, timeout=30)[0].error


def test_submit_does_not_block_and_workers_overlap():
    with pool_lib.RewardPool(sleepy, num_workers=2, timeout_s=10) as p:
        p.submit("warm", 0, "", None)
        p.wait_group("warm", 1, timeout=30)
        start = time.monotonic()
        for i in range(4):
            p.submit("g", i, "", None)
        submit_s = time.monotonic() - start
        p.wait_group("g", 4, timeout=30)
        total_s = time.monotonic() - start
    assert submit_s < 0.2  # 4 x 0.4 s of work queued without waiting for any of it
    # 2 workers x 2 rounds of 0.4 s = 0.8 s; serial would be 1.6 s.
    assert 0.8 <= total_s < 1.5


def test_thread_backend_abandons_a_hung_thread():
    with pool_lib.RewardPool(exact_match, num_workers=1, timeout_s=0.5, backend="thread") as p:
        p.submit("t", 0, "hang", "a")
        p.submit("t", 1, "a", "a")  # runs on the replacement thread
        out = p.wait_group("t", 2, timeout=30)
        assert out[0].timed_out and out[1].outcome
        assert p.metrics()["reward/worker_restarts"] == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        pool_lib.RewardPool(exact_match, backend="gpu")
    with pytest.raises(ValueError, match="num_workers"):
        pool_lib.RewardPool(exact_match, num_workers=0)
    with pytest.raises(TypeError, match="'reward' and 'outcome'"):
        pool_lib.normalize_reward({"reward": 1.0})
    p = pool_lib.RewardPool(exact_match, num_workers=1, backend="thread")
    p.close()
    with pytest.raises(RuntimeError, match="after close"):
        p.submit("g", 0, "a", "a")


def test_a_worker_whose_pool_closed_before_it_started_ends_quietly():
    """A pool closed at once may close its end of a thread worker's pipe before the worker
    says "ready" (seen in CI as an unhandled BrokenPipeError in the thread): the worker loop
    returns instead of raising."""
    parent, child = multiprocessing.Pipe(duplex=True)
    parent.close()
    assert pool_lib._serve(child, exact_match, None) is None


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_warmup_runs_before_work_and_is_not_timed(backend):
    """A scorer that takes 1.5 s to load, under a 0.75 s timeout: with `warmup()` every response
    is scored; without it the first response times out, and with processes its replacement,
    loading again, too: the reason warmup exists (threads share the object, so the abandoned
    thread's load finishes for the next one)."""
    from helpers.reward_pool_fns import SlowToLoad

    for warm in (True, False):
        with pool_lib.RewardPool(SlowToLoad(1.5, warm=warm), num_workers=1, timeout_s=0.75,
                                 backend=backend) as p:
            for i, text in enumerate(["a", "b", "a"]):
                p.submit("g", i, text, "a")
            out = p.wait_group("g", 3, timeout=60)
        if warm:
            assert [(r.outcome, r.failed) for r in out] == [(True, False), (False, False),
                                                            (True, False)]
        elif backend == "process":
            assert all(r.timed_out for r in out)
        else:
            assert out[0].timed_out


def test_a_failing_warmup_fails_that_workers_responses_with_its_error():
    from helpers.reward_pool_fns import SlowToLoad

    with pool_lib.RewardPool(SlowToLoad(0.0, fail_warmup=True), num_workers=1,
                             timeout_s=5.0) as p:
        p.submit("g", 0, "a", "a")
        (r,) = p.wait_group("g", 1, timeout=60)
    assert r.failed and not r.timed_out and "warmup OSError: scorer file missing" in r.error
