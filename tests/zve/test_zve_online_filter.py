"""MS-ZVE stage 4: online filtering of zero-variance groups, bounded refill, keep-rate requests."""

import warnings

import numpy as np
import pytest
from helpers.zve_groups import make_group

from espo_jax.zve.config import default_zve_config
from espo_jax.zve.groups import ScoredGroup
from espo_jax.zve.online_filter import OnlineFilter, filter_groups


def _group(outcomes):
    return ScoredGroup(make_group(outcomes), np.asarray(outcomes, np.float32))


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
    assert sum(filter_groups(g.outcomes for g in result.batch)) == 3
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
    assert len(result.batch) == 4 and all(filter_groups(g.outcomes for g in result.batch))
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


def test_with_rl_zvp_on_the_filter_keeps_zero_variance_groups():
    cfg = default_zve_config()
    cfg.online_filter.enabled = cfg.zvp.enabled = True
    flt = OnlineFilter.for_zve(cfg)
    gen = ScriptedGenerator(informative_per_call=0)  # all-right groups only
    result = flt.collect(3, gen)
    assert flt.keep_zero_variance and gen.requests == [3] and len(result.batch) == 3


def test_without_wrong_groups_the_filter_drops_all_wrong_zero_variance_groups():
    """`zvp.wrong_groups=False`: RL-ZVP leaves all-wrong groups at a zero advantage, so they
    carry no gradient; the filter drops them (and refills) and keeps the all-correct ones."""
    cfg = default_zve_config()
    cfg.online_filter.enabled = cfg.zvp.enabled = True
    cfg.zvp.wrong_groups = False
    cfg.online_filter.max_refill_rounds = 0
    flt = OnlineFilter.for_zve(cfg)
    script = [_group([1, 1]), _group([0, 0]), _group([1, 0]), _group([0, 0])]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        cfg.online_filter.pad_with_filtered = False
        result = OnlineFilter.for_zve(cfg).collect(4, lambda n: script[:n])
    assert [list(g.outcomes) for g in result.batch] == [[1, 1], [1, 0]]
    assert not flt.keep_wrong and flt.keep_zero_variance
