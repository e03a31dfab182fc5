"""Length-aware scheduling: predictor, admission order, LPT balancing, slot simulation."""

import itertools
import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from espo_jax.rollout import scheduling


def makespan(work: Sequence[float], assignment: Sequence[Sequence[int]]) -> float:
    """The largest total work assigned to one worker."""
    return max((sum(float(work[i]) for i in items) for items in assignment), default=0.0)


def simulate_slots(lengths: Sequence[int], n_slots: int,
                   order: Sequence[int]) -> tuple[int, float]:
    """Decode steps and idle-slot fraction of continuous batching over `n_slots` slots.

    Request `order[j]` occupies a slot for `lengths[order[j]]` steps; a slot that frees takes
    the next request at once. Returns `(steps, idle_fraction)` where idle_fraction is the share
    of slot-steps with no request. A model of the engine's driver: admission policies compared
    without running a model.
    """
    free_at = [0] * n_slots
    for i in order:
        s = min(range(n_slots), key=lambda s: free_at[s])
        free_at[s] += int(lengths[i])
    steps = max(free_at, default=0)
    if steps == 0:
        return 0, 0.0
    busy = sum(int(n) for n in lengths)
    return steps, 1.0 - busy / (steps * n_slots)


def test_predictor_history_and_prior():
    p = scheduling.LengthPredictor(prior_length=100.0, ema=0.5)
    assert p.predict("unseen") == 100.0  # nothing observed: the configured prior
    p.observe("a", [10, 20])
    assert p.predict("a") == 15.0  # mean(10, 20)
    assert p.predict("unseen") == 15.0  # prior = mean over observed groups
    p.observe("a", [30, 30])
    assert p.predict("a") == 22.5  # 0.5 * 30 + 0.5 * 15
    p.observe("b", [4])
    assert p.predict("b") == 4.0
    assert p.predict("c") == pytest.approx(49 / 3)  # (15 + 30 + 4) / 3 groups
    restored = scheduling.LengthPredictor.from_state_dict(json.loads(json.dumps(p.state_dict())))
    assert restored.predict("a") == 22.5 and restored.predict("c") == pytest.approx(49 / 3)


def test_predictor_rejects_bad_input():
    with pytest.raises(ValueError, match="prior_length"):
        scheduling.LengthPredictor(prior_length=0)
    with pytest.raises(ValueError, match="ema"):
        scheduling.LengthPredictor(ema=1.5)
    with pytest.raises(ValueError, match="no lengths"):
        scheduling.LengthPredictor().observe("a", [])


def test_admission_order():
    assert scheduling.admission_order([3, 9, 9, 1], "fifo") == [0, 1, 2, 3]
    # Descending, ties (the two 9s) in request order.
    assert scheduling.admission_order([3, 9, 9, 1], "longest_first") == [1, 2, 0, 3]
    with pytest.raises(ValueError, match="longest_first"):
        scheduling.admission_order([1], "shortest")


def test_balance_lpt_by_hand():
    # Sorted: 7, 5, 4, 3, 3. w0 <- 7; w1 <- 5; w1 (5) <- 4 = 9; w0 (7) <- 3 = 10; w1 (9) <- 3 = 12.
    work = [7, 5, 4, 3, 3]
    assignment = scheduling.balance_lpt(work, 2)
    assert assignment == [[0, 3], [1, 2, 4]]
    assert makespan(work, assignment) == 12  # optimum 11 (7+4 | 5+3+3): within 4/3
    with pytest.raises(ValueError, match="n_workers"):
        scheduling.balance_lpt(work, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=0, max_size=7), st.integers(1, 3))
def test_balance_lpt_within_four_thirds_of_optimum(work, n_workers):
    assignment = scheduling.balance_lpt(work, n_workers)
    assert sorted(i for items in assignment for i in items) == list(range(len(work)))

    def load(choice, k):
        return sum(w for w, a in zip(work, choice, strict=True) if a == k)

    choices = itertools.product(range(n_workers), repeat=len(work))
    best = min((max(load(c, k) for k in range(n_workers)) for c in choices), default=0)
    # Graham's bound for LPT: makespan <= (4/3 - 1/(3m)) * OPT.
    assert makespan(work, assignment) <= (4 / 3 - 1 / (3 * n_workers)) * best + 1e-9


def test_simulate_slots_longest_first_removes_the_tail():
    lengths = [1, 1, 1, 1, 4]
    # FIFO on 2 slots: the four 1-step requests take steps 0-2, then the 4-step one runs alone
    # on one slot for steps 2-6: 6 steps, 12 slot-steps, 8 busy -> idle 1/3.
    steps, idle = simulate_slots(lengths, 2, scheduling.admission_order(lengths))
    assert (steps, idle) == (6, pytest.approx(1 / 3))
    # Longest first: the 4-step request on slot 0, the four others on slot 1: 4 steps, 0 idle.
    order = scheduling.admission_order(lengths, "longest_first")
    assert simulate_slots(lengths, 2, order) == (4, 0.0)
