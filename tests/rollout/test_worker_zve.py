"""MS-ZVE stages 0, 1 and 5 in a rollout worker decide what the single-process loop decides.

The worker (`RolloutWorker` with a `PromptScheduler`, its buffer writer, reward pool and state
files) and the single-process pipeline (`ZVEPipeline`) are driven by the same scripted outcomes:
a sampler whose responses spell out a fixed per-(prompt, visit, sample) verdict, scored by the
real reward pool. Both must ask for the same prompts with the same sample counts, in the same
order, offline pass included, and a worker stopped and restarted from its state file must go on
exactly as one that never stopped. The sampler is the only scripted part: it stands in for the
engine so that the outcomes are known in advance. A script with failing reward calls (the
reward function raises) checks that both read a failed call as a missing outcome alike.
"""

import collections

import jax
import numpy as np
import pytest

from espo_jax import models
from espo_jax.buffer import BufferReader, weights
from espo_jax.rollout.batching import Generation, GenerationGroup
from espo_jax.rollout.worker_loop import RolloutWorker, WorkerConfig
from espo_jax.zve import PromptScheduler, ZVEPipeline, default_zve_config

N_PROMPTS, PER_BATCH, BATCHES, SEED = 12, 4, 12, 7
RIGHT, WRONG, FAIL = 1, 2, 3  # response token ids; the detokeniser spells them "Y", "N", "T"
PASS_RATES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.0)  # prompt i gets PASS_RATES[i % 6]


def verdict(prompt_index: int, visit: int, sample: int, failing: bool = False) -> bool | None:
    """The script: prompt i's samples are right at its pass rate, the pattern turning by visit.
    With `failing`, the reward call fails (None) on every sample of prompt 7 and on the odd
    samples of prompts 1, 5 and 9."""
    if failing and (prompt_index == 7 or (prompt_index % 4 == 1 and sample % 2)):
        return None
    rate = PASS_RATES[prompt_index % len(PASS_RATES)]
    return (sample + 3 * visit + prompt_index) % 4 < round(4 * rate)


class Script:
    """Outcomes by prompt and visit (each time a prompt is sampled counts as a visit)."""

    def __init__(self, failing: bool = False):
        self.visits = collections.Counter()
        self.plans: list[list[tuple[str, int]]] = []
        self.failing = failing

    def outcomes(self, prompt_id: str, n: int) -> list[bool | None]:
        i = int(prompt_id[1:])
        v = self.visits[prompt_id]
        self.visits[prompt_id] += 1
        return [verdict(i, v, j, self.failing) for j in range(n)]


TOKEN = {True: RIGHT, False: WRONG, None: FAIL}


class ScriptedSampler:
    """A `rollout.sampler.Sampler` whose responses are the script's verdicts."""

    sampler_name, n_experts, last_stats = "scripted", None, {}

    def __init__(self, script: Script):
        self.script = script

    def load(self, version, path, model_config):
        pass

    def request_stop(self):
        pass

    def generate_groups(self, requests, *, rng, admission="fifo", predictor=None, on_group=None):
        self.script.plans.append([(str(r.prompt_id), r.n_samples) for r in requests])
        out = []
        for i, r in enumerate(requests):
            gens = [Generation(tokens=np.array([TOKEN[ok], 0], np.int32),
                               logprobs=np.zeros(2, np.float32), routed_experts=None,
                               finish_reason="stop")
                    for ok in self.script.outcomes(str(r.prompt_id), r.n_samples)]
            group = GenerationGroup(i, r.prompt_id, np.asarray(r.tokens, np.int32), gens)
            on_group(group)
            out.append(group)
        return out


def detokenize(ids):
    return "".join({RIGHT: "Y", WRONG: "N", FAIL: "T"}.get(int(t), "") for t in ids)


def reward(text, answer):
    if text.startswith("T"):
        raise TimeoutError("scripted reward failure")
    return text.startswith("Y")


def prompts():
    return [{"prompt_id": f"p{i}", "tokens": [1, 3 + i], "answer": "Y"} for i in range(N_PROMPTS)]


def zve_config():
    """Stages 0, 1 and 5 on (stage 4 on too, passing everything with stage 3 on, as the
    default experiment: the filter lives on the learner in the worker layout)."""
    c = default_zve_config()
    for stage in ("offline", "adaptive", "retire", "zvp", "online_filter"):
        c[stage].enabled = True
    c.n_samples = 4
    c.offline.k, c.offline.low, c.offline.high = 4, -1.0, 1.0  # prunes the always-right ones
    c.adaptive.min_samples, c.adaptive.max_samples = 4, 8
    c.retire.solved_streak = c.retire.failed_streak = 2
    c.retire.reprobe_every = 2
    c.retire.reprobe_frac = 0.5
    return c


def sync_decisions(batches: int, failing: bool = False) -> tuple[list, PromptScheduler]:
    """What the single-process loop's MS-ZVE asks for, offline rounds first. A failed reward
    call is recorded as the reward pool and `generate_scored_groups` record it."""
    script = Script(failing)

    def group(p, n):
        from espo_jax.buffer import Response, RolloutGroup

        verdicts = script.outcomes(str(p["prompt_id"]), n)
        return RolloutGroup(
            prompt_id=str(p["prompt_id"]), prompt_tokens=np.asarray(p["tokens"], np.int32),
            policy_version=0, sampler="scripted", created_at=0.0,
            meta={"reward_failed": [j for j, ok in enumerate(verdicts) if ok is None]},
            responses=[Response(tokens=np.array([TOKEN[ok], 0], np.int32),
                                logprobs=np.zeros(2, np.float32), outcome=bool(ok),
                                reward=float(bool(ok)))
                       for ok in verdicts])

    def rollout(plan):
        script.plans.append([(str(p["prompt_id"]), n) for p, n in plan])
        return [group(p, n) for p, n in plan]

    zve = ZVEPipeline(prompts(), zve_config(), seed=SEED, max_len=2)
    zve.offline_prune(rollout)
    for _ in range(batches):
        zve.step(PER_BATCH, rollout)
    return script.plans, zve.scheduler


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A published weights version for the worker to start from (the sampler ignores it)."""
    root = tmp_path_factory.mktemp("weights")
    config = models.get_preset("tiny")
    params = jax.device_get(jax.jit(models.init_params, static_argnums=0)(
        config, jax.random.key(0)))
    weights.publish(root, 0, config, params)
    return str(root)


def run_worker(published, workdir, script, max_batches):
    config = WorkerConfig(published, str(workdir / "buffer"), prompts_per_batch=PER_BATCH,
                          reward_backend="thread", reward_workers=1, max_batches=max_batches,
                          status_dir=str(workdir / "workers"), heartbeat_s=0.2, seed=SEED)
    worker = RolloutWorker(config, PromptScheduler(prompts(), zve_config(), seed=SEED), reward,
                           detokenize=detokenize, sampler=ScriptedSampler(script), log=lambda m: 0)
    worker.run()
    return worker


def test_worker_schedules_as_the_single_process_loop(published, tmp_path):
    expected, sync_scheduler = sync_decisions(BATCHES)
    script = Script()
    worker = run_worker(published, tmp_path, script, BATCHES)
    assert script.plans == expected
    # The stages acted: stage 0 pruned the always-right prompts, stage 1 varied the sample
    # counts, stage 5 retired prompts and re-probed them.
    totals = worker.scheduler.totals
    assert totals["pruned"] == 4 and totals["retired"] > 0 and totals["reprobed"] > 0
    assert {n for plan in expected[-BATCHES:] for _, n in plan} >= {4, 8}
    assert worker.scheduler.state_dict() == sync_scheduler.state_dict()
    # Offline samples stay out of the buffer: it holds the 12 batches' groups, scored.
    groups = BufferReader(tmp_path / "buffer").read(1000, timeout_s=0)
    assert [(g.prompt_id, g.num_responses) for g in groups] == [
        e for plan in expected[-BATCHES:] for e in plan]
    assert all(r.outcome == (r.tokens[0] == RIGHT) for g in groups for r in g.responses)


def test_a_restarted_worker_continues_where_it_stopped(published, tmp_path):
    expected, _ = sync_decisions(BATCHES)
    script = Script()  # one script: outcomes continue across the restart, as a policy's would
    run_worker(published, tmp_path, script, 5)
    second = run_worker(published, tmp_path, script, BATCHES - 5)
    assert script.plans == expected  # no offline pass again, no prompt lost or repeated
    assert second.batch_index == BATCHES
    groups = BufferReader(tmp_path / "buffer").read(1000, timeout_s=0)
    assert len(groups) == PER_BATCH * BATCHES


def test_failed_reward_calls_are_missing_outcomes_in_both_layouts(published, tmp_path):
    expected, sync_scheduler = sync_decisions(BATCHES, failing=True)
    script = Script(failing=True)
    worker = run_worker(published, tmp_path, script, BATCHES)
    assert script.plans == expected
    assert worker.scheduler.state_dict() == sync_scheduler.state_dict()
    sched = worker.scheduler
    # p7's calls all fail: no pass rate, no history, never pruned or retired, n_samples each
    # visit; p1 (1 right of 4 at odd samples failing) still has known outcomes
    p7, p1 = sched._lookup("p7"), sched._lookup("p1")
    assert sched.trials[p7] == 0.0 and sched.status[p7] == "active"
    assert {n for plan in expected[-BATCHES:] for pid, n in plan if pid == "p7"} == {4}
    assert sched.trials[p1] > 0.0 and sched.totals["missing_outcomes"] > 0
    assert worker.status()["zve"]["zve/missing_outcomes_total"] == sched.totals[
        "missing_outcomes"]
    # the buffer's records list exactly the failed responses
    groups = BufferReader(tmp_path / "buffer").read(1000, timeout_s=0)
    assert any(g.meta.get("reward_failed") for g in groups)
    for g in groups:
        fails = [j for j, r in enumerate(g.responses) if r.tokens[0] == FAIL]
        assert g.meta.get("reward_failed", []) == fails
        assert all(not r.outcome and r.reward == 0.0 for j, r in enumerate(g.responses)
                   if j in fails)
