"""The rollout worker: in-process with a weights reload between batches, and as a subprocess
built from an experiment config (its share of the prompts, `--until_version`, SIGTERM in the
middle of a batch); both workers' command lines."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading

import jax
import pytest

from espo_jax import models, run_setup
from espo_jax.buffer import BufferReader, weights
from espo_jax.buffer.shards import list_tmp_files
from espo_jax.rollout import mismatch
from espo_jax.rollout import worker as worker_lib
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.rollout.worker_loop import RolloutWorker, WorkerConfig
from espo_jax.tokenizer import CharTokenizer
from espo_jax.zve import PromptScheduler

CONFIG = models.get_preset("tiny")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENT = os.path.join(REPO, "experiments", "arith_espo.py")
WORKER_FLAGS = ("--config", "--workdir", "--worker_index", "--num_workers", "--max_batches",
                "--until_version", "--stats")
TOK = CharTokenizer()


def decode(ids):  # the tiny model has 128 ids for 99 characters
    return TOK.decode(ids, errors="replace")


def prompt_list(n):
    return [
        {
            "prompt_id": f"p{i}",
            "tokens": TOK.encode(f"{i}+{i}=", add_bos=True),
            "answer": str(2 * i),
        }
        for i in range(n)
    ]


def text_length(text, answer):
    return float(len(text))


@pytest.fixture(scope="module")
def params():
    init = jax.jit(models.init_params, static_argnums=0)
    return [jax.device_get(init(CONFIG, jax.random.key(s))) for s in (0, 1)]


def read_all(buffer_dir):
    return BufferReader(buffer_dir).read(1000, timeout_s=0)


def test_worker_writes_groups_and_reloads_weights(tmp_path, params):
    publish, buffer = tmp_path / "weights", tmp_path / "buffer"
    weights.publish(publish, 1, CONFIG, params[0])

    def prompts():  # v2 appears while the worker takes the second batch's prompts
        for i, p in enumerate(prompt_list(8)):
            if i == 4:
                weights.publish(publish, 2, CONFIG, params[1])
            yield p

    config = WorkerConfig(
        str(publish),
        str(buffer),
        n_samples=2,
        prompts_per_batch=4,
        reward_backend="thread",
        sampling=SamplingConfig(max_new_tokens=8, stop_tokens=(TOK.eos_id,)),
        max_slots=4,
        max_cache_len=64,
    )
    worker = RolloutWorker(config, prompts(), text_length, detokenize=decode)
    stats = worker.run()
    assert (stats["worker/batches"], stats["worker/groups_written"]) == (2, 8)
    assert (stats["worker/weight_loads"], stats["worker/policy_version"]) == (2, 2)
    groups = read_all(buffer)
    assert [g.prompt_id for g in groups] == [f"p{i}" for i in range(8)]
    assert [g.policy_version for g in groups] == [1] * 4 + [2] * 4
    for g in groups:
        assert g.sampler == "jax-fp32" and g.rewarded_at is not None and len(g.responses) == 2
        for r in g.responses:
            assert r.reward == len(decode(r.tokens))  # scored by the pool
            assert r.routed_experts.shape == (g.prompt_length + r.length, 2, 2)
    # The log-probs come from the weights each batch says it used (v2 differs from v1).
    assert (
        mismatch.measure_mismatch(CONFIG, params[0], groups[:4], False)["mismatch/logp_abs_max"]
        < 1e-5
    )
    assert (
        mismatch.measure_mismatch(CONFIG, params[1], groups[4:], False)["mismatch/logp_abs_max"]
        < 1e-5
    )
    assert (
        mismatch.measure_mismatch(CONFIG, params[0], groups[4:], False)["mismatch/logp_abs_mean"]
        > 1e-3
    )


def test_worker_without_weights_times_out(tmp_path):
    config = WorkerConfig(
        str(tmp_path / "none"), str(tmp_path / "b"), weights_timeout_s=0.2, poll_s=0.05
    )
    worker = RolloutWorker(config, prompt_list(1), text_length)
    with pytest.raises(TimeoutError, match="no weights published in .*none"):
        worker.run()


def _experiment_config():
    spec = importlib.util.spec_from_file_location("arith_espo", EXPERIMENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("small")


def _run_worker(workdir, *flags, **popen):
    cmd = [sys.executable, "-m", "espo_jax.rollout.worker", "--config", f"{EXPERIMENT}:small",
           "--workdir", str(workdir), *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


@pytest.mark.parametrize("module", ["espo_jax.rollout.worker", "espo_jax.rollout.vllm_cli"])
def test_both_workers_take_the_same_flags(module, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", module, *a], capture_output=True,
                                    text=True, timeout=120, cwd=tmp_path)
    helped = run("--help")  # absl prints the module doc and the flags, and exits 1
    assert f"python -m {module} --config" in helped.stdout, helped.stdout + helped.stderr
    assert all(f"  {flag}: " in helped.stdout for flag in WORKER_FLAGS), helped.stdout
    bad = run("--config", f"{EXPERIMENT}:small", "--workdir", str(tmp_path), "--publish_dir=w")
    assert bad.returncode == 1 and "Unknown command line flag 'publish_dir'" in bad.stderr
    missing = run("--workdir", str(tmp_path / "run"))
    assert missing.returncode == 1 and "Flag --config must have a value" in missing.stderr
    index = run("--config", f"{EXPERIMENT}:small", "--workdir", str(tmp_path / "run"),
                "--worker_index=2", "--num_workers=2")
    assert index.returncode == 1 and "--worker_index must be in [0, --num_workers)" in index.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was prepared or written


def _scheduler(config, index, num_workers, workdir):
    """The prompt scheduler worker `index` of `num_workers` runs (`worker.main_from_config`)."""
    train = run_setup.build(config, str(workdir)).train_prompts
    share = run_setup.worker_share(train, index, num_workers)
    return PromptScheduler(share, config.zve, seed=config.seed * 1000 + index)


NO_OFFLINE = "--config.zve.offline.enabled=False"  # stage 0's pass is tested on its own


def test_worker_share_of_the_prompts_until_a_version(tmp_path, params):
    """Worker 1 of 2 schedules the training prompts 1, 3, 5, ... (2 per batch: 4 prompts per
    step over 2 workers); `--until_version=1` ends it after its first batch at v1."""
    weights.publish(tmp_path / "weights", 1, CONFIG, params[0])
    stats = tmp_path / "stats.json"
    proc = _run_worker(tmp_path, "--worker_index=1", "--num_workers=2", "--until_version=1",
                       f"--stats={stats}", "--config.rollout.prompts_per_step=4",
                       "--config.rollout.max_new_tokens=8", NO_OFFLINE)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log[-3000:]
    counters = json.loads(stats.read_text())
    assert (counters["worker/batches"], counters["worker/groups_written"]) == (1, 2), counters
    config = _experiment_config()
    config.zve.offline.enabled = False
    plan = _scheduler(config, 1, 2, tmp_path).next_prompts(2)
    groups = read_all(tmp_path / "buffer")
    assert [(g.prompt_id, g.num_responses) for g in groups] == [
        (p["prompt_id"], n) for p, n in plan]
    ids = [p["prompt_id"] for p in run_setup.build(config, str(tmp_path)).train_prompts]
    assert {g.prompt_id for g in groups} <= set(ids[1::2])  # worker 1's share only
    assert all(g.policy_version == 1 and g.meta["worker"] == "rollout-1" for g in groups)
    status = json.loads((tmp_path / "workers" / "rollout-1.json").read_text())
    assert status["state"] == "done" and status["worker/groups_written"] == 2
    assert status["zve"]["zve/active"] == len(ids[1::2])


def test_sigterm_mid_batch_drops_the_batch_and_a_restart_regenerates_it(tmp_path, params):
    """With a prompt scheduler a stopped batch is not written in part: the restarted worker
    resumes the scheduler's state and samples exactly the batch an uninterrupted worker would
    have (the same prompts, sample counts and RNG stream)."""
    weights.publish(tmp_path / "weights", 1, CONFIG, params[0])
    # 8 prompts x 4 samples of up to 40 tokens per batch on 4 slots: a batch takes a while.
    flags = ("--config.zve.n_samples=4", "--config.rollout.prompts_per_step=8",
             "--config.rollout.max_new_tokens=40", "--config.rollout.num_slots=4",
             "--config.rollout.reward_workers=1", NO_OFFLINE)
    proc = _run_worker(tmp_path, *flags)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("batch 1: generating"):
                proc.send_signal(signal.SIGTERM)
                break
        rest = threading.Thread(target=lambda: lines.extend(proc.stdout))
        rest.start()
        assert proc.wait(timeout=120) == 0, "".join(lines)
        rest.join()
    finally:
        proc.kill()
    log = "".join(lines)
    assert "batch 0: wrote 8 groups" in log, log
    assert "batch 1: stopped; dropped the unfinished batch" in log, log
    first = read_all(tmp_path / "buffer")
    assert len(first) == 8 and list_tmp_files(str(tmp_path / "buffer")) == []
    restarted = _run_worker(tmp_path, *flags, "--max_batches=1")
    log2 = restarted.communicate(timeout=300)[0]
    assert restarted.returncode == 0, log2[-3000:]
    assert "resumed the prompt scheduler at batch 1" in log2, log2
    config = _experiment_config()
    config.zve.offline.enabled = False
    config.zve.n_samples = 4
    sched = _scheduler(config, 0, 1, tmp_path)
    plans = [sched.next_prompts(8)]
    sched.observe_groups(first)
    plans.append(sched.next_prompts(8))
    groups = read_all(tmp_path / "buffer")
    assert len(groups) == 16
    for plan, batch in zip(plans, (groups[:8], groups[8:]), strict=True):
        assert [(g.prompt_id, g.num_responses) for g in batch] == [
            (p["prompt_id"], n) for p, n in plan]
    for g in groups:  # every group has its scored responses
        assert all(r.reward is not None and r.outcome is not None for r in g.responses)


def test_workers_that_do_not_divide_the_step_are_refused(tmp_path):
    """External workers (`--num_workers`) must split `rollout.prompts_per_step` evenly; the
    check comes before any data is prepared or weights awaited."""
    with pytest.raises(ValueError, match=r"prompts_per_step=4 must be divisible by the 3 workers"):
        worker_lib.main_from_config(_experiment_config(), str(tmp_path), index=0, num_workers=3)
    assert list(tmp_path.iterdir()) == []
