"""The rollout worker: in-process with a weights reload between batches, and as a subprocess
stopped by SIGTERM in the middle of a batch."""

import json
import os
import signal
import subprocess
import sys
import threading

import jax
import pytest

from espo_jax import models
from espo_jax.buffer import BufferReader, weights
from espo_jax.buffer.shards import list_tmp_files
from espo_jax.models.tokenizer import CharTokenizer
from espo_jax.rollout import mismatch
from espo_jax.rollout import worker as worker_lib
from espo_jax.rollout.sampling import SamplingConfig

CONFIG = models.get_preset("tiny")
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

    config = worker_lib.WorkerConfig(
        str(publish),
        str(buffer),
        n_samples=2,
        prompts_per_batch=4,
        reward_backend="thread",
        sampling=SamplingConfig(max_new_tokens=8, stop_tokens=(TOK.eos_id,)),
        max_slots=4,
        max_cache_len=64,
    )
    worker = worker_lib.RolloutWorker(config, prompts(), text_length, detokenize=decode)
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
    config = worker_lib.WorkerConfig(
        str(tmp_path / "none"), str(tmp_path / "b"), weights_timeout_s=0.2, poll_s=0.05
    )
    worker = worker_lib.RolloutWorker(config, prompt_list(1), text_length)
    with pytest.raises(TimeoutError, match="no weights published in .*none"):
        worker.run()


def test_bad_prompt_file_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_id": "a", "text": "1+1="}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: .*missing \['answer'\]"):
        worker_lib.main(["--publish_dir", "w", "--buffer_dir", "b", "--prompts", str(path)])


def test_sigterm_mid_batch_writes_only_complete_groups(tmp_path, params):
    publish, buffer = tmp_path / "weights", tmp_path / "buffer"
    weights.publish(publish, 1, CONFIG, params[0])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in prompt_list(24)))
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=os.path.expanduser("~/.cache/espo_jax/jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
    )
    cmd = [
        sys.executable,
        "-m",
        "espo_jax.rollout.worker",
        "--publish_dir",
        str(publish),
        "--buffer_dir",
        str(buffer),
        "--prompts",
        str(prompts),
        "--reward",
        "espo_jax.rewards.pool:exact_match",
        "--n_samples",
        "4",
        "--prompts_per_batch",
        "8",
        "--max_new_tokens",
        "40",
        "--max_slots",
        "4",
        "--max_cache_len",
        "64",
        "--reward_workers",
        "1",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("batch 1: generating"):
                proc.send_signal(signal.SIGTERM)  # 32 samples of up to 40 tokens on 4 slots
                break
        rest = threading.Thread(target=lambda: lines.extend(proc.stdout))
        rest.start()
        assert proc.wait(timeout=120) == 0, "".join(lines)
        rest.join()
    finally:
        proc.kill()
    log = "".join(lines)
    assert "batch 0: wrote 8 groups" in log, log
    assert "batch 1: stopped; wrote" in log, log  # generation was cut, not finished
    assert "batch 2" not in log
    groups = read_all(buffer)
    ids = [int(g.prompt_id[1:]) for g in groups]
    assert ids[:8] == list(range(8))  # batch 0 whole
    assert ids[8:] == sorted(ids[8:]) and set(ids[8:]) < set(range(8, 16))  # some of batch 1
    for g in groups:  # no partial group: every one has its G scored responses
        assert len(g.responses) == 4 and all(r.reward is not None for r in g.responses)
    assert list_tmp_files(str(buffer)) == []
    dropped = int(log.split("dropped ")[1].split()[0])
    assert dropped > 0 and dropped + 4 * (len(ids) - 8) == 32  # 8 prompts x 4 samples
