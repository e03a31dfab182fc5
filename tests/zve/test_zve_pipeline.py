"""ZVEPipeline on a simulated policy: every stage combination in one loop, state round trip,
and the rollout groups left as the rollout made them."""

import json
import warnings

import numpy as np
import pytest
from helpers.zve_groups import make_group, reward_fields

from espo_jax.zve.config import default_zve_config
from espo_jax.zve.pipeline import ZVEPipeline

# 10 prompts the policy always solves, 5 it never solves, 5 at a coin flip: with G = 8 a group
# is zero-variance with probability 1, 1 and 2 / 2^8 -> expected (10 + 5 + 5/128) / 20 = .752
PASS_RATES = [1.0] * 10 + [0.0] * 5 + [0.5] * 5
PROMPTS = [{"prompt_id": f"q{i}"} for i in range(len(PASS_RATES))]
MAX_LEN = 40
STAGES = ("offline", "adaptive", "tie_break", "zvp", "online_filter", "retire")


class SimulatedPolicy:
    """Outcomes ~ Bernoulli(pass rate), lengths uniform in [5, 40], step credits uniform in
    [0, 1); seeded per call. The reward function's reward is -3 (MS-ZVE must not use it)."""

    def __init__(self, seed=0):
        self.calls, self.seed, self.groups = 0, seed, []

    def __call__(self, plan):
        groups = []
        for prompt, n in plan:
            i = int(prompt["prompt_id"][1:])
            rng = np.random.default_rng([self.seed, self.calls, i])
            outcomes = (rng.random(n) < PASS_RATES[i]).astype(int).tolist()
            groups.append(make_group(outcomes, rng.integers(5, MAX_LEN + 1, n).tolist(),
                                     pid=prompt["prompt_id"], credits=rng.random(n).tolist(),
                                     rewards=[-3.0] * n))
        self.calls += 1
        self.groups += groups
        return groups


def _run(cfg, steps=30, groups_per_step=4):
    zve = ZVEPipeline(PROMPTS, cfg, seed=0, max_len=MAX_LEN)
    policy = SimulatedPolicy()
    pruned, offline = zve.offline_prune(policy)
    with warnings.catch_warnings():  # refill exhaustion is expected with 5 informative prompts
        warnings.simplefilter("ignore", RuntimeWarning)
        history = [zve.step(groups_per_step, policy) for _ in range(steps)]
    no_signal = sum(m["zve/no_signal_tokens"] for _, m in history)
    tokens = sum(m["zve/tokens_generated"] for _, m in history)
    return zve, pruned, offline, history, no_signal / tokens


def test_plain_grpo_wastes_what_the_pass_rates_predict():
    _, pruned, offline, history, no_signal_frac = _run(default_zve_config())
    assert pruned == [] and offline == {}
    assert all(len(batch) == 4 for batch, _ in history)
    # 120 groups; expected zero-variance share .752 (module comment), binomial sd ~ .04
    assert 0.62 < no_signal_frac < 0.88
    assert all(np.all(g.rewards == g.outcomes) for b, _ in history for g in b)


def _all_stages(zvp):
    cfg = default_zve_config()
    for stage in STAGES:
        cfg[stage].enabled = True
    cfg.zvp.enabled = zvp
    return cfg


def test_all_stages_but_rl_zvp_cut_the_waste():
    zve, pruned, offline, history, no_signal_frac = _run(_all_stages(zvp=False))
    # stage 0 prunes exactly the 15 settled prompts (k = 8 samples of rate 0 or 1)
    assert sorted(pruned) == sorted(f"q{i}" for i in range(15))
    # early stop: the 15 settled prompts take all 8 samples; a coin-flip prompt stops at its
    # first outcome that differs from the first (>= 2 samples, at most 8)
    assert 15 * 8 + 5 * 2 <= offline["zve/offline_rollouts"] <= 20 * 8
    # left: the coin-flip prompts; the filter keeps the batch full (static size)
    assert all(len(batch) == 4 for batch, _ in history)
    # stage 1 (target .1): p = .5 needs n = 5 (2 / 2^5 = .0625), rounded up to 8; re-probes
    # of pruned prompts (stage 5) take 4
    assert 4.0 <= np.mean([m["zve/samples_per_prompt"] for _, m in history]) <= 8.0
    # only padding on exhausted steps can bring a zero-variance group into the batch; each
    # exhaustion is counted
    for _, m in history:
        assert m["zve/zero_variance_frac_after_filter"] <= m["zve/filter_padded"] / 4
    assert history[-1][1]["zve/refill_exhausted"] == sum(
        m["zve/filter_padded"] > 0 for _, m in history)
    # left: the filter's surplus and the re-probes of pruned prompts, versus ~.75 for plain GRPO
    assert no_signal_frac < 0.1
    assert all(g.rewards.dtype == np.float32 for b, _ in history for g in b)


def test_with_rl_zvp_the_filter_drops_nothing():
    # RL-ZVP gives zero-variance groups an advantage, so the filter keeps them: one generation
    # round per step, every group trained on, and no generated token without signal
    _, pruned, _, history, no_signal_frac = _run(_all_stages(zvp=True))
    assert len(pruned) == 15
    assert all(m["zve/refill_rounds"] == 0 and m["zve/filter_padded"] == 0 for _, m in history)
    assert all(m["zve/groups_generated"] == len(b) == 4 for b, m in history)
    assert no_signal_frac == 0.0
    # the re-probes of pruned prompts (stage 5) bring zero-variance groups into the batch
    assert sum(m["zve/zero_variance_frac_before"] for _, m in history) > 0


def test_step_leaves_the_rollout_groups_untouched():
    # Every stage on, stage 2 ranking wrong responses by step credit: the rewards the step
    # returns are MS-ZVE's, and no response of any generated group has its fields changed.
    cfg = _all_stages(zvp=False)
    cfg.tie_break.wrong_score = "step_credit"
    zve = ZVEPipeline(PROMPTS, cfg, seed=0, max_len=MAX_LEN)
    policy = SimulatedPolicy()
    zve.offline_prune(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        batches = [zve.step(4, policy)[0] for _ in range(10)]
    before = [(g.prompt_id, [(r.outcome, r.length, dict(r.reward_components))
                             for r in g.responses]) for g in policy.groups]
    assert reward_fields(policy.groups) == [[-3.0] * g.num_responses for g in policy.groups]
    generated = {id(g) for g in policy.groups}
    for batch in batches:
        for s in batch:
            assert id(s.group) in generated  # the rollout's own objects, not copies
            assert not np.any(s.rewards == -3.0)  # tie-broken rewards, not the records'
            assert s.rewards.shape == (s.group.num_responses,)
    after = [(g.prompt_id, [(r.outcome, r.length, dict(r.reward_components))
                            for r in g.responses]) for g in policy.groups]
    assert after == before


def test_retirement_alone_lowers_waste_over_epochs():
    cfg = default_zve_config()
    cfg.retire.enabled = True
    cfg.retire.reprobe_every = 50  # no re-probing within the run
    _, _, _, history, _ = _run(cfg, steps=40)
    first_epoch = np.mean([m["zve/zero_variance_frac_before"] for _, m in history[:5]])
    late = np.mean([m["zve/zero_variance_frac_before"] for _, m in history[-5:]])
    # after 3 epochs (5 steps each) the 15 settled prompts are retired
    assert history[-1][1]["zve/retired"] == 15
    assert first_epoch > 0.5 and late < 0.1


def test_pipeline_state_round_trip():
    cfg = default_zve_config()
    cfg.adaptive.enabled = cfg.retire.enabled = cfg.online_filter.enabled = True
    a = ZVEPipeline(PROMPTS, cfg, seed=3, max_len=MAX_LEN)
    policy = SimulatedPolicy(seed=1)
    with warnings.catch_warnings():  # refill exhaustion is expected with 5 informative prompts
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(7):
            a.step(4, policy)
    state = json.loads(json.dumps(a.state_dict()))
    # the checkpoint format of every earlier version (old checkpoints restore)
    assert set(state) == {"scheduler", "filter"}
    assert set(state["filter"]) == {"exhausted", "steps", "keep_rate"}
    b = ZVEPipeline(PROMPTS, cfg, seed=3, max_len=MAX_LEN)
    b.load_state_dict(state)
    policy_b = SimulatedPolicy(seed=1)
    policy_b.calls = policy.calls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(5):
            (batch_a, ma), (batch_b, mb) = a.step(4, policy), b.step(4, policy_b)
            assert ma == mb
            assert [g.prompt_id for g in batch_a] == [g.prompt_id for g in batch_b]


def test_rollout_must_follow_the_plan():
    zve = ZVEPipeline(PROMPTS, default_zve_config(), max_len=MAX_LEN)
    with pytest.raises(ValueError, match="does not match the plan"):
        zve.step(1, lambda plan: [make_group([1], [3], pid=p["prompt_id"]) for p, _ in plan])
