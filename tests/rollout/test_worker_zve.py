"""MS-ZVE stages 0, 1 and 5 in a rollout worker decide what the single-process loop decides.

The worker (`RolloutWorker` with a `PromptScheduler`, its buffer writer, reward pool and state
files) and the single-process pipeline (`ZVEPipeline`) are driven by the same scripted outcomes:
a sampler whose responses spell out a fixed per-(prompt, visit, sample) verdict, scored by the
real reward pool. Both must ask for the same prompts with the same sample counts, in the same
order, offline pass included, and a worker stopped and restarted from its state file must go on
exactly as one that never stopped. The sampler is the only scripted part: it stands in for the
engine so that the outcomes are known in advance.
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
RIGHT, WRONG = 1, 2  # response token ids; the detokeniser spells them "Y" and "N"
PASS_RATES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.0)  # prompt i gets PASS_RATES[i % 6]


def verdict(prompt_index: int, visit: int, sample: int) -> bool:
    """The script: prompt i's samples are right at its pass rate, the pattern turning by visit."""
    rate = PASS_RATES[prompt_index % len(PASS_RATES)]
    return (sample + 3 * visit + prompt_index) % 4 < round(4 * rate)


class Script:
    """Outcomes by prompt and visit (each time a prompt is sampled counts as a visit)."""

    def __init__(self):
        self.visits = collections.Counter()
        self.plans: list[list[tuple[str, int]]] = []

    def outcomes(self, prompt_id: str, n: int) -> list[bool]:
        i = int(prompt_id[1:])
        v = self.visits[prompt_id]
        self.visits[prompt_id] += 1
        return [verdict(i, v, j) for j in range(n)]


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
            gens = [Generation(tokens=np.array([RIGHT if ok else WRONG, 0], np.int32),
                               logprobs=np.zeros(2, np.float32), routed_experts=None,
                               finish_reason="stop")
                    for ok in self.script.outcomes(str(r.prompt_id), r.n_samples)]
            group = GenerationGroup(i, r.prompt_id, np.asarray(r.tokens, np.int32), gens)
            on_group(group)
            out.append(group)
        return out


def detokenize(ids):
    return "".join({RIGHT: "Y", WRONG: "N"}.get(int(t), "") for t in ids)


def reward(text, answer):
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


def sync_decisions(batches: int) -> tuple[list, PromptScheduler]:
    """What the single-process loop's MS-ZVE asks for, offline rounds first."""
    script = Script()

    def rollout(plan):
        script.plans.append([(str(p["prompt_id"]), n) for p, n in plan])
        from espo_jax.buffer import Response, RolloutGroup

        return [RolloutGroup(
            prompt_id=str(p["prompt_id"]), prompt_tokens=np.asarray(p["tokens"], np.int32),
            policy_version=0, sampler="scripted", created_at=0.0,
            responses=[Response(tokens=np.array([RIGHT if ok else WRONG, 0], np.int32),
                                logprobs=np.zeros(2, np.float32), outcome=ok, reward=float(ok))
                       for ok in script.outcomes(str(p["prompt_id"]), n)])
            for p, n in plan]

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
