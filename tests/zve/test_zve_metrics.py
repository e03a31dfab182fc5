"""MS-ZVE's per-step metrics on hand-built groups."""

import pytest
from helpers.zve_groups import make_group

from espo_jax.zve.groups import ScoredGroup
from espo_jax.zve.metrics import step_metrics


def _group(outcomes, lengths, rewards=None):
    return ScoredGroup(make_group(outcomes, lengths), outcomes if rewards is None else rewards)


def test_step_metrics_by_hand():
    g0 = _group([1, 1], [3, 5], rewards=[1.1, 1.0])  # all right, tie broken by length
    g1 = _group([0, 0], [4, 4])  # all wrong, dropped by the filter
    g2 = _group([1, 0], [2, 6])  # informative
    g3 = _group([1, 1], [5, 5], rewards=[1.0, 1.0])  # all right, equal lengths: still tied
    generated, batch = [g0, g1, g2, g3], [g0, g2, g3]
    m = step_metrics(generated, batch)
    assert m["zve/zero_variance_frac_before"] == 3 / 4  # g0, g1, g3 by outcome
    assert m["zve/zero_variance_frac_after_tiebreak"] == 2 / 4  # g1, g3 by reward
    assert m["zve/zero_variance_frac_after_filter"] == 1 / 3  # g3 of the batch
    assert m["zve/tokens_generated"] == 8 + 8 + 8 + 10
    # no signal: g1 (not trained: 2 rollouts, 8 tokens) + g3 (no contrast: 2, 10)
    assert m["zve/no_signal_rollouts"] == 4 and m["zve/no_signal_tokens"] == 18
    assert m["zve/no_signal_token_frac"] == pytest.approx(18 / 34)
    assert m["zve/effective_batch"] == 2 and m["zve/batch_groups"] == 3
    # The papers' zero-variance rate, by binary outcome: g0, g1, g3 of the generated groups
    # (6 rollouts, 8 + 8 + 10 tokens), g0 and g3 of the batch (tie-break or not).
    assert m["zve/zv_outcome_rollouts"] == 6 and m["zve/zv_outcome_tokens"] == 26
    assert m["zve/zero_variance_frac_batch_outcome"] == 2 / 3
    # Trained tokens 8 + 8 + 10; without gradient: g3's 10 (g0's tie is broken by length).
    assert m["zve/trained_tokens"] == 26 and m["zve/trained_zero_adv_tokens"] == 10
    assert all(type(v) is float for v in m.values())
    m = step_metrics(generated, batch, zvp_enabled=True)  # RL-ZVP: g3 still has signal
    assert m["zve/no_signal_tokens"] == 8 and m["zve/effective_batch"] == 3
    assert m["zve/trained_zero_adv_tokens"] == 0  # ... but the zero-variance rate is unchanged
    assert m["zve/zero_variance_frac_before"] == 3 / 4
    # An all-wrong group trained on: RL-ZVP's -1 sign gives it a gradient only with
    # wrong_groups; without, its 8 tokens have no signal and it is not effective.
    wrong = [g0, g1, g2, g3]
    m = step_metrics(generated, wrong, zvp_enabled=True)
    assert m["zve/no_signal_tokens"] == 0 and m["zve/effective_batch"] == 4
    m = step_metrics(generated, wrong, zvp_enabled=True, zvp_wrong=False)
    assert m["zve/no_signal_tokens"] == 8 and m["zve/effective_batch"] == 3
    with pytest.raises(ValueError, match="taken from generated"):
        step_metrics([g0], [g1])
    with pytest.raises(ValueError, match="taken from generated"):
        step_metrics([g0], [g0, g0])
