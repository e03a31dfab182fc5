"""The zve benchmark's accounting: a scripted policy with hand-computed token counts, and the
real engine + reward pool on a tiny random model."""

import dataclasses

import jax
import numpy as np
import pytest

from espo_jax.bench import zve as bench
from espo_jax.bench.zve_spend import Spend, current_figures, engine_rollout, numbered, spend_budget
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.models import get_preset, init_params
from espo_jax.rewards.pool import RewardPool
from espo_jax.rollout.engine import Engine
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.zve.config import default_zve_config

# Scripted policy: p0 always right, p1 always wrong, p2 and p3 mixed; every response of pi
# has LENGTHS[i] tokens. With G = 2 one epoch (each prompt once) generates
# 2 * (3 + 5 + 7 + 11) = 52 tokens, of which p0 and p1's 2 * (3 + 5) = 16 have no contrast.
LENGTHS = {"p0": 3, "p1": 5, "p2": 7, "p3": 11}
OUTCOMES = {"p0": [1, 1], "p1": [0, 0], "p2": [1, 0], "p3": [0, 1]}
PROMPTS = [{"prompt_id": pid} for pid in LENGTHS]


def _group(pid, outcomes, length):
    """A scored RolloutGroup: every response `length` tokens."""
    responses = [Response(tokens=np.full(length, 3, np.int32), logprobs=np.zeros(length),
                          outcome=o, reward=float(o)) for o in outcomes]
    return RolloutGroup(prompt_id=pid, prompt_tokens=np.array([1], np.int32), policy_version=0,
                        sampler="test", created_at=0.0, responses=responses)


class ScriptedPolicy:
    """Sample j of prompt pi (counted over calls) has outcome OUTCOMES[pi][j % 2]."""

    def __init__(self):
        self.plans, self.drawn = [], dict.fromkeys(LENGTHS, 0)

    def __call__(self, plan):
        self.plans.append([(p["prompt_id"], n) for p, n in plan])
        out = []
        for p, n in plan:
            pid, j = p["prompt_id"], self.drawn[p["prompt_id"]]
            self.drawn[pid] += n
            out.append(_group(pid, [OUTCOMES[pid][(j + i) % 2] for i in range(n)],
                              LENGTHS[pid]))
        return out


def _config(*stages, n_samples=2):
    c = default_zve_config()
    c.n_samples = c.offline.k = n_samples
    for stage in stages:
        c[stage].enabled = True
    return c


def _spend(config, budget, prompts=PROMPTS, offline=None):
    policy = ScriptedPolicy()
    return spend_budget(prompts, config, policy, budget_tokens=budget,
                        groups_per_step=2, max_len=16, offline_rollout=offline)


def test_stage_configs_add_one_stage_at_a_time_then_drop_rl_zvp():
    configs = bench.stage_configs(default_zve_config())
    assert [label for label, _ in configs] == [*bench.LABELS, bench.NO_ZVP]
    for i, (_, c) in enumerate(configs[:-1]):
        assert [c[s].enabled for s in bench.STAGES] == [j < i for j in range(6)]
    assert [configs[-1][1][s].enabled for s in bench.STAGES] == [1, 1, 1, 0, 1, 1]


def test_plain_grpo_spends_two_epochs():
    # budget 104 = 2 epochs: after 3 steps at most 52 + 2 * (7 + 11) = 88 < 104 tokens, so
    # exactly 4 steps, whatever the epoch order; no signal in 2 * 16 = 32 -> 32 / 104
    s = _spend(_config(), 104)
    assert (s.steps, s.tokens, s.no_signal_tokens, s.offline_tokens) == (4, 104, 32, 0)
    assert s.no_signal_token_frac == s.no_signal_token_frac_with_offline == pytest.approx(
        32 / 104)
    assert (s.groups, s.zero_variance_groups, s.trained_groups, s.signal_groups) == (8, 4, 8, 4)
    # p0 and p1 twice: 4 groups of 2 rollouts, 32 tokens, all trained on without gradient.
    assert (s.zero_variance_rollouts, s.zero_variance_tokens) == (8, 32)
    assert (s.trained_zero_variance_groups, s.trained_tokens, s.trained_zero_adv_tokens) == (
        4, 104, 32)
    row = bench.table({"plain GRPO": s}).splitlines()[-1]
    assert "50.0%" in row and "8 / 32" in row and "30.8%" in row  # 4/8 groups, 32/104 tokens


def test_rl_zvp_gives_every_trained_group_signal():
    s = _spend(_config("zvp"), 104)
    assert (s.tokens, s.no_signal_tokens, s.signal_groups) == (104, 0, 8)
    # RL-ZVP gives those groups a gradient; it does not change the zero-variance rate.
    assert (s.zero_variance_groups, s.trained_zero_variance_groups) == (4, 4)
    assert s.trained_zero_adv_tokens == 0


def test_offline_pass_counts_as_no_signal_and_is_shared():
    # offline: 4 prompts x k=2 = 52 tokens; p0, p1 pruned. Each step then takes p2 and p3:
    # 2 * (7 + 11) = 36 tokens, all with contrast. 52 + 36 = 88 < 104 <= 124 -> 2 steps.
    underlying, cache = ScriptedPolicy(), {}
    for _ in range(2):
        offline = numbered(lambda i, plan: underlying(plan), cache)
        s = _spend(_config("offline"), 104, offline=offline)
        assert (s.steps, s.tokens, s.offline_tokens, s.no_signal_tokens, s.pruned) == (
            2, 124, 52, 0, 2)
        assert s.no_signal_token_frac_with_offline == pytest.approx(52 / 124)
        assert s.no_signal_token_frac == 0.0
    # the early-stopped pass ran once, in k = 2 rounds of one sample per prompt; the second
    # configuration reused it
    assert underlying.plans == [[(pid, 1) for pid in LENGTHS]] * 2


def test_filter_exhaustion_leaves_no_signal_without_raising():
    # only p0 and p1 (never any contrast); filter: request round(2 * 1.5) = 3 groups, drop all,
    # one refill of 3 more -> 6 groups = 3 epochs of (2 * 3 + 2 * 5) = 16 tokens = 48 tokens,
    # then 2 dropped groups pad the batch. Budget 48 -> one step, no signal at all.
    c = _config("online_filter")
    c.online_filter.max_refill_rounds = 1
    s = _spend(c, 48, prompts=PROMPTS[:2])
    assert (s.steps, s.tokens, s.no_signal_tokens, s.groups) == (1, 48, 48, 6)
    assert (s.trained_groups, s.signal_groups, s.refill_exhausted) == (2, 0, 1)


def test_stops_when_stage_0_prunes_every_prompt():
    s = _spend(_config("offline"), 1000, prompts=PROMPTS[:2])  # offline 2 * (3 + 5) = 16
    assert (s.steps, s.tokens, s.no_signal_tokens, s.offline_tokens) == (0, 16, 0, 16)
    assert s.no_signal_token_frac_with_offline == 1.0
    assert s.stopped == "stage 0 pruned all 2 prompts"
    assert "(stage 0 pruned all 2 prompts)" in bench.table({"+0 offline prune": s})


def test_a_budget_the_offline_pass_spends_alone_is_said_to_be_too_small():
    # Stage 0's pass costs 52 tokens (offline test above): a budget of 40 leaves its
    # configuration no step, a table row of dashes; plain GRPO steps twice (an epoch, 52).
    results = {"plain GRPO": _spend(_config(), 40), "+0 offline prune": _spend(
        _config("offline"), 40, offline=numbered(lambda i, plan: ScriptedPolicy()(plan)))}
    assert (results["plain GRPO"].steps, results["+0 offline prune"].steps) == (2, 0)
    row = [c.strip() for c in bench.table(results).splitlines()[-1].split("|")]
    assert row.count("-") == 3  # ZV rates generated and trained, zero-adv. trained tokens
    warning = bench.budget_warning(results, 40)
    assert warning.startswith("warning: --budget 40 tokens is too small to compare the stages: "
                              "1 of 2 configurations ran no RL step (+0 offline prune)")
    assert "offline pass (52 tokens)" in warning
    assert bench.budget_warning({k: _spend(c, 104) for k, c in (
        ("plain GRPO", _config()), ("+0 offline prune", _config("offline")))}, 104) is None


def test_stored_figures_are_read_under_the_current_names():
    """A configuration of experiments/results/zve_bench.json (written before the names of
    `espo_jax.zve.accounting`): its `wasted_tokens` counted the offline pass's too."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results",
                        "zve_bench.json")
    with open(path) as f:
        stored = json.load(f)["configurations"]["+0 offline prune"]
    c = current_figures(stored)
    assert c["no_signal_tokens"] == stored["wasted_tokens"] - stored["offline_tokens"]
    assert c["trained_zero_adv_tokens"] == stored["trained_no_grad_tokens"]
    s = Spend(**{k: c[k] for k in Spend.__dataclass_fields__})
    assert s.no_signal_token_frac_with_offline == pytest.approx(stored["wasted_frac"])
    assert s.no_signal_token_frac == pytest.approx(stored["online_wasted_frac"])


def test_bad_budget_is_an_error():
    with pytest.raises(ValueError, match="budget_tokens"):
        _spend(_config(), 0)


def ids_text(ids):
    return " ".join(str(int(t)) for t in ids)


def first_token_even(text, answer):
    """Reward of the engine test: a coin flip of the random policy (first token's parity)."""
    return int(text.split()[0]) % 2 == 0


@pytest.fixture(scope="module")
def engine_and_pool():
    config = get_preset("tiny")
    engine = Engine(config, init_params(config, jax.random.key(0)), max_slots=8,
                    max_cache_len=16, sampling=SamplingConfig(max_new_tokens=6))
    pool = RewardPool(first_token_even, num_workers=1, backend="thread", detokenize=ids_text)
    yield engine, pool, config.n_experts
    pool.close()


def test_engine_rollout_tokens_and_outcomes_add_up(engine_and_pool):
    engine, pool, n_experts = engine_and_pool
    prompts = [{"prompt_id": f"q{i}", "tokens": [1, 3 + i, 7], "answer": ""} for i in range(6)]
    c = _config("zvp", n_samples=4)
    generate = engine_rollout(engine, pool, seed=0, n_experts=n_experts,
                              target_fn=lambda p: p["answer"])
    seen, calls = [], []

    def recording(i, plan):
        calls.append(i)
        groups = generate(i, plan)
        seen.extend(groups)
        return groups

    cache = {}
    s = spend_budget(prompts, c, numbered(recording, cache), budget_tokens=60,
                     groups_per_step=3, max_len=6)
    # every response has 1..6 tokens: 3 groups x 4 responses = 12..72 tokens a step
    assert all(1 <= n <= 6 for g in seen for n in g.response_lengths)
    assert s.tokens == sum(int(g.response_lengths.sum()) for g in seen) >= 60
    flat = sum(len(set(g.outcomes)) == 1 for g in seen)
    assert (s.groups, s.zero_variance_groups, s.signal_groups) == (len(seen), flat, len(seen))
    assert 0 < sum(g.outcomes.sum() for g in seen) < 4 * len(seen)  # both outcomes occur
    assert pool.metrics()["reward/failed"] == 0 and calls == list(range(s.steps))
    # the same requests again: answered from the cache, generating nothing ...
    again = spend_budget(prompts, c, numbered(recording, cache), budget_tokens=60,
                         groups_per_step=3, max_len=6)
    assert calls == list(range(s.steps))
    # ... and equal to generating them afresh (call i draws with key i)
    fresh = spend_budget(prompts, c, numbered(generate), budget_tokens=60,
                         groups_per_step=3, max_len=6)
    assert dataclasses.replace(again, wall_s=0.0) == dataclasses.replace(s, wall_s=0.0)
    assert dataclasses.replace(fresh, wall_s=0.0) == dataclasses.replace(s, wall_s=0.0)


def _save_policy(directory, config, step):
    """A random policy of `config`'s model saved as a train state at `step` under `directory`."""
    import functools

    from espo_jax import run_setup
    from espo_jax.train import state as state_lib
    from espo_jax.train.checkpoint import Checkpointer

    params = jax.jit(functools.partial(init_params, run_setup.model_architecture(config)))(
        jax.random.key(0))
    ckpt = Checkpointer(str(directory), async_save=False)
    ckpt.save(step, state_lib.create_train_state(
        params, state_lib.make_optimizer(config.optim, total_steps=10), jax.random.key(1)), {})
    ckpt.close()


def _bench_zve(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "espo_jax.bench", "zve", *args],
                          capture_output=True, text=True, timeout=600)


def test_quick_mode_refuses_a_checkpoint_of_the_full_model_naming_both(tmp_path):
    """`bench zve --quick --init_from RUN` with RUN a run of experiments/arith_espo.py (the
    `small` model): one message naming both models, before anything runs; the full mode
    refuses the quick mode's `tiny` checkpoint the same way."""
    from espo_jax import cli_errors

    full, quick = bench.bench_config(False, None, None), bench.bench_config(True, None, None)
    assert (full.model.preset, quick.model.preset) == ("small", "tiny")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # a warm-start-only run: RL saved nothing
    _save_policy(run / "warmstart", full, 0)
    proc = _bench_zve("--quick", f"--init_from={run}")
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[0] == (
        f"error: --init_from {run}: {run}/warmstart/0 is a checkpoint of the `small` model "
        "(experiments/arith_espo.py, the one `bench zve` uses), but `bench zve --quick` uses the "
        "`tiny` model (experiments/arith_espo.py:small); leave out --quick, or give the WORKDIR "
        "of a run of experiments/arith_espo.py:small")
    # The quick model's checkpoint, given to the full mode.
    tiny_run = tmp_path / "tiny_run"
    _save_policy(tiny_run / "checkpoints", quick, 3)
    with pytest.raises(cli_errors.CommandLineError,
                       match=r"checkpoints/3 is a checkpoint of the `tiny` model .* but `bench "
                             r"zve` uses the `small` model .*; add --quick"):
        bench.check_init_from(False, bench.bench_config(False, None, str(tiny_run)),
                              str(tiny_run))


@pytest.mark.slow
def test_a_budget_too_small_for_the_offline_pass_is_said_end_to_end(tmp_path):
    """`bench zve --quick --init_from RUN --budget 200` (RUN: the quick model's checkpoint):
    the run completes, and the configurations that ran no step (stage 0's pass spent the
    budget) are named in a warning after the table and in the figures."""
    import json

    _save_policy(tmp_path / "run" / "checkpoints", bench.bench_config(True, None, None), 3)
    out = tmp_path / "zve.json"
    proc = _bench_zve("--quick", f"--init_from={tmp_path / 'run'}", "--budget=200",
                      f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    idle = [k for k, c in figures["configurations"].items() if c["steps"] == 0]
    assert idle and "plain GRPO" not in idle  # plain GRPO has no offline pass: it steps
    warning = figures["warning"]
    assert warning in proc.stdout.splitlines()
    assert warning.startswith(f"warning: --budget 200 tokens is too small to compare the stages: "
                              f"{len(idle)} of 8 configurations ran no RL step ({', '.join(idle)})")
