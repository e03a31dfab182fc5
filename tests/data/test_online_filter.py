"""Stage 4 (online filter, bounded refill), step metrics, and stage 3's switch reaching RL-ZVP."""

import warnings

import numpy as np
import pytest

from espo_jax.data.online_filter import OnlineFilter, filter_groups
from espo_jax.data.zve_config import default_zve_config
from espo_jax.data.zve_metrics import step_metrics


def _group(outcomes, lengths=None, rewards=None):
    g = {"prompt_id": "p", "outcomes": outcomes, "lengths": lengths or [4] * len(outcomes)}
    if rewards is not None:
        g["rewards"] = rewards
    return g


def test_filter_groups_uses_binary_outcomes_of_ragged_groups():
    mask = filter_groups([[1, 1, 1, 1], [0, 1], [0, 0, 0], [1], [1, 0, 0, 0, 0, 0, 0, 0]])
    assert mask.tolist() == [False, True, False, False, True]
    with pytest.raises(ValueError, match="binary"):
        filter_groups([[1.0, 1.12]])  # a shaped reward is refused


class ScriptedGenerator:
    """Returns groups, one informative ([1, 0]) per call, the rest all-right; records requests."""

    def __init__(self, informative_per_call=1):
        self.requests, self.k = [], informative_per_call

    def __call__(self, n):
        self.requests.append(n)
        return [_group([1, 0] if j < self.k else [1, 1]) for j in range(n)]


def _filter_cfg(**kw):
    cfg = default_zve_config().online_filter
    cfg.enabled = True
    cfg.oversample = 1.5
    cfg.max_refill_rounds = 2
    cfg.update(kw)
    return cfg


def test_refill_exhaustion_warns_counts_and_pads():
    flt = OnlineFilter(_filter_cfg())
    gen = ScriptedGenerator()
    with pytest.warns(RuntimeWarning, match="3 of 4 groups") as rec:
        result = flt.collect(4, gen)
    # keep rate starts at 1/1.5, so round 1 asks 4 * 1.5 = 6 -> 1 kept; keep rate
    # .5 * .667 + .5 * 1/6 = .42, factor min(1.5, 1/.42) = 1.5: round 2 asks 3 * 1.5 = 4.5 -> 5,
    # 2 kept; round 3 (refill 2 = max) asks 2 * 1.5 = 3 -> 3 kept; out of rounds with 3 of 4
    assert gen.requests == [6, 5, 3]
    assert "3 of 4 groups" in str(rec[0].message)
    assert result.rounds == 3 and result.exhausted and len(result.generated) == 14
    assert len(result.batch) == 4 and result.padded == 1  # one zero-variance group tops up
    assert sum(filter_groups(g["outcomes"] for g in result.batch)) == 3
    assert flt.exhausted == 1 and flt.metrics(result)["zve/refill_rounds"] == 2
    # again: the counter goes on, and without padding the batch is just what there is
    flt.config.pad_with_filtered = False
    with pytest.warns(RuntimeWarning):
        result = flt.collect(4, ScriptedGenerator())
    assert len(result.batch) == 3 and result.padded == 0
    assert flt.metrics(result)["zve/refill_exhausted"] == 2


def test_refill_until_full_without_warning():
    flt = OnlineFilter(_filter_cfg(max_refill_rounds=5))
    gen = ScriptedGenerator(informative_per_call=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = flt.collect(4, gen)
    # 6 -> 2 kept; keep rate .5 * .667 + .5 * 1/3 = .5, factor 1.5: 2 * 1.5 = 3 -> 4 kept
    assert gen.requests == [6, 3] and result.rounds == 2 and not result.exhausted
    assert len(result.batch) == 4 and all(filter_groups(g["outcomes"] for g in result.batch))
    assert flt.exhausted == 0


def test_request_follows_the_keep_rate():
    flt = OnlineFilter(_filter_cfg())
    gen = ScriptedGenerator(informative_per_call=100)  # every group informative
    surplus = [flt.collect(4, gen).surplus for _ in range(3)]
    # 6 (keep rate -> .5 * .667 + .5 = .833, factor 1.2); 4 * 1.2 = 4.8 -> 5 (-> .917, 1.09);
    # 4 * 1.09 = 4.36 -> 4: the surplus of informative groups shrinks to 0
    assert gen.requests == [6, 5, 4] and surplus == [2, 1, 0]


def test_surplus_is_reported_and_disabled_stage_passes_through():
    result = OnlineFilter(_filter_cfg()).collect(2, ScriptedGenerator(informative_per_call=3))
    assert len(result.batch) == 2 and result.surplus == 1  # 3 informative of ceil(2*1.5)=3
    off = default_zve_config().online_filter
    gen = ScriptedGenerator()
    result = OnlineFilter(off).collect(4, gen)
    assert gen.requests == [4] and result.batch == result.generated and len(result.batch) == 4


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
    # wasted: g1 (not trained: 2 rollouts, 8 tokens) + g3 (no contrast: 2, 10)
    assert m["zve/wasted_rollouts"] == 4 and m["zve/wasted_tokens"] == 18
    assert m["zve/wasted_token_frac"] == pytest.approx(18 / 34)
    assert m["zve/effective_batch"] == 2 and m["zve/batch_groups"] == 3
    m = step_metrics(generated, batch, zvp_enabled=True)  # RL-ZVP: g3 still has signal
    assert m["zve/wasted_tokens"] == 8 and m["zve/effective_batch"] == 3
    with pytest.raises(ValueError, match="taken from generated"):
        step_metrics([g0], [g1])
    with pytest.raises(ValueError, match="2 outcomes, 3 lengths"):
        step_metrics([_group([1, 0], [1, 2, 3])], [])


def test_stage3_switch_reaches_rl_zvp():
    """The learner applies stage 3; its config alpha turns a tied group into signal."""
    from espo_jax.rl.advantages import rl_zvp

    cfg = default_zve_config()
    cfg.zvp.enabled = True
    outcomes = np.array([[1.0, 1.0], [1.0, 0.0]])
    entropy = np.array([[[0.5, 1.0], [2.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
    mask = np.array([[[1, 1], [1, 0]], [[1, 1], [1, 1]]])
    adv = np.asarray(rl_zvp(outcomes, outcomes, entropy, mask, cfg.zvp.alpha))
    # all-right group 0: A_t = alpha * H_t = 0.1 * [.5, 1], 0.1 * [2, (masked) 0]
    np.testing.assert_allclose(adv[0], [[0.05, 0.1], [0.2, 0.0]], rtol=1e-6)
    # mixed group 1: GRPO (1 - .5) / std(.5) = +1 and -1 on every token
    np.testing.assert_allclose(adv[1], [[1.0, 1.0], [-1.0, -1.0]], rtol=1e-4)
