"""ZVEPipeline on a simulated policy: every stage combination in one loop, state round trip."""

import json
import warnings

import numpy as np
import pytest

from espo_jax.data.zve_config import default_zve_config
from espo_jax.data.zve_pipeline import ZVEPipeline

# 10 prompts the policy always solves, 5 it never solves, 5 at a coin flip: with G = 8 a group
# is zero-variance with probability 1, 1 and 2 / 2^8 -> expected (10 + 5 + 5/128) / 20 = .752
PASS_RATES = [1.0] * 10 + [0.0] * 5 + [0.5] * 5
PROMPTS = [{"prompt_id": f"q{i}"} for i in range(len(PASS_RATES))]
MAX_LEN = 40


class SimulatedPolicy:
    """Outcomes ~ Bernoulli(pass rate), lengths uniform in [5, 40]; seeded per call."""

    def __init__(self, seed=0):
        self.calls, self.seed = 0, seed

    def __call__(self, plan):
        groups = []
        for prompt, n in plan:
            i = int(prompt["prompt_id"][1:])
            rng = np.random.default_rng([self.seed, self.calls, i])
            groups.append({"prompt_id": prompt["prompt_id"],
                           "outcomes": (rng.random(n) < PASS_RATES[i]).astype(int).tolist(),
                           "lengths": rng.integers(5, MAX_LEN + 1, n).tolist()})
        self.calls += 1
        return groups


def _run(cfg, steps=30, groups_per_step=4):
    zve = ZVEPipeline(PROMPTS, cfg, seed=0, max_len=MAX_LEN)
    policy = SimulatedPolicy()
    pruned, offline = zve.offline_prune(policy)
    with warnings.catch_warnings():  # refill exhaustion is expected with 5 informative prompts
        warnings.simplefilter("ignore", RuntimeWarning)
        history = [zve.step(groups_per_step, policy) for _ in range(steps)]
    wasted = sum(m["zve/wasted_tokens"] for _, m in history)
    tokens = sum(m["zve/tokens_generated"] for _, m in history)
    return zve, pruned, offline, history, wasted / tokens


def test_plain_grpo_wastes_what_the_pass_rates_predict():
    _, pruned, offline, history, wasted_frac = _run(default_zve_config())
    assert pruned == [] and offline == {}
    assert all(len(batch) == 4 for batch, _ in history)
    # 120 groups; expected zero-variance share .752 (module comment), binomial sd ~ .04
    assert 0.62 < wasted_frac < 0.88
    assert all(np.all(g["rewards"] == g["outcomes"]) for b, _ in history for g in b)


def _all_stages(zvp):
    cfg = default_zve_config()
    for stage in ("offline", "adaptive", "tie_break", "zvp", "online_filter", "retire"):
        cfg[stage].enabled = True
    cfg.zvp.enabled = zvp
    return cfg


def test_all_stages_but_rl_zvp_cut_the_waste():
    zve, pruned, offline, history, wasted_frac = _run(_all_stages(zvp=False))
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
    assert wasted_frac < 0.1
    assert all(g["rewards"].dtype == np.float32 for b, _ in history for g in b)


def test_with_rl_zvp_the_filter_drops_nothing():
    # RL-ZVP gives zero-variance groups an advantage, so the filter keeps them: one generation
    # round per step, every group trained on, and no generated token without signal
    _, pruned, _, history, wasted_frac = _run(_all_stages(zvp=True))
    assert len(pruned) == 15
    assert all(m["zve/refill_rounds"] == 0 and m["zve/filter_padded"] == 0 for _, m in history)
    assert all(m["zve/groups_generated"] == len(b) == 4 for b, m in history)
    assert wasted_frac == 0.0
    # the re-probes of pruned prompts (stage 5) bring zero-variance groups into the batch
    assert sum(m["zve/zero_variance_frac_before"] for _, m in history) > 0


def test_offline_early_stop_keeps_the_decisions_and_saves_samples():
    # outcome j of prompt i is SCRIPT[i][j]: the same samples with and without the early stop
    script = {"a": [1, 1, 1, 1], "b": [0, 0, 0, 0], "c": [1, 0, 1, 1], "d": [0, 0, 0, 1],
              "e": [1, 1, 1, 0]}
    prompts = [{"prompt_id": pid} for pid in script]

    def run(early_stop, low):
        drawn = dict.fromkeys(script, 0)

        def policy(plan):
            out = []
            for p, n in plan:
                pid, j = p["prompt_id"], drawn[p["prompt_id"]]
                drawn[pid] += n
                out.append({"prompt_id": pid, "outcomes": script[pid][j:j + n],
                            "lengths": [10] * n})
            return out

        cfg = default_zve_config()
        cfg.offline.enabled, cfg.offline.k, cfg.offline.low = True, 4, low
        cfg.offline.early_stop = early_stop
        zve = ZVEPipeline(prompts, cfg, max_len=MAX_LEN)
        pruned, m = zve.offline_prune(policy)
        return sorted(pruned), drawn, m, zve

    full_pruned, full_drawn, full_m, _ = run(False, 0.0)
    assert full_pruned == ["a", "b"] and full_m["zve/offline_rollouts"] == 20
    pruned, drawn, m, zve = run(True, 0.0)
    # a, b can be pruned until the end; c is mixed after 2, d after 4, e after 4
    assert pruned == full_pruned and drawn == {"a": 4, "b": 4, "c": 2, "d": 4, "e": 4}
    assert m["zve/offline_rollouts"] == 18 and m["zve/offline_tokens"] == 180
    # stage 1's history holds what was drawn: c at 1 right of 2
    assert zve.scheduler.trials[zve.scheduler._lookup("c")] == 2.0
    assert zve.scheduler.pass_rate("c") == 0.5
    # low < 0 (only always-solved prompts are pruned): the first wrong outcome settles a prompt
    pruned, drawn, _, _ = run(True, -1.0)
    assert pruned == ["a"] and drawn == {"a": 4, "b": 1, "c": 2, "d": 1, "e": 4}


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
    b = ZVEPipeline(PROMPTS, cfg, seed=3, max_len=MAX_LEN)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    policy_b = SimulatedPolicy(seed=1)
    policy_b.calls = policy.calls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(5):
            (batch_a, ma), (batch_b, mb) = a.step(4, policy), b.step(4, policy_b)
            assert ma == mb
            assert [g["prompt_id"] for g in batch_a] == [g["prompt_id"] for g in batch_b]


def test_rollout_must_follow_the_plan():
    zve = ZVEPipeline(PROMPTS, default_zve_config(), max_len=MAX_LEN)
    with pytest.raises(ValueError, match="does not match the plan"):
        zve.step(1, lambda plan: [{"prompt_id": p["prompt_id"], "outcomes": [1],
                                   "lengths": [3]} for p, _ in plan])
