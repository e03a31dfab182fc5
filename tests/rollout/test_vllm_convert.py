"""vLLM outputs -> records, on hand-built outputs with vLLM's real attribute names and shapes.

The classes below copy the fields of vllm 0.32.0's `CompletionOutput`, `RequestOutput` and
`Logprob` (vllm/outputs.py, vllm/logprobs.py); vLLM itself is not imported.
"""

import dataclasses
import json
import sys
import types
from typing import Any

import numpy as np
import pytest

from espo_jax.buffer import records
from espo_jax.rollout.vllm_convert import (
    RoutingMissingError,
    VllmOutputError,
    output_from_dict,
    output_to_dict,
    request_output_to_group,
)

M, K, E = 2, 2, 8  # MoE layers, top-k, experts


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: np.ndarray | None = None  # [seq_len, layer_num, topk]
    finish_reason: str | None = None
    stop_reason: Any = None


class RequestOutput:
    """vLLM >= 0.22 layout: no prompt_routed_experts attribute."""

    def __init__(self, prompt_token_ids, outputs):
        self.request_id = "0"
        self.prompt = None
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = None
        self.outputs = outputs
        self.finished = True


class SplitRequestOutput(RequestOutput):
    """Older layout: prompt routing on the request, generated-token routing per completion."""

    def __init__(self, prompt_token_ids, outputs, prompt_routed_experts):
        super().__init__(prompt_token_ids, outputs)
        self.prompt_routed_experts = prompt_routed_experts


def routing(n_tokens: int, offset: int, dtype=np.uint8) -> np.ndarray:
    """[n, M, K] expert ids: token i, layer m, slot j -> (offset + 3i + 2m + j) % E."""
    i, m, j = np.meshgrid(np.arange(n_tokens), np.arange(M), np.arange(K), indexing="ij")
    return ((offset + 3 * i + 2 * m + j) % E).astype(dtype)


def completion(index, tokens, *, routed=None, finish="stop", extra_logprobs=False):
    # Sampled token t at step s gets log-prob -(index + 1) * 0.5 - 0.1 * s.
    logprobs = []
    for s, tok in enumerate(tokens):
        entry = {tok: Logprob(-(index + 1) * 0.5 - 0.1 * s, rank=1)}
        if extra_logprobs:  # logprobs=1: the top-1 alternative comes along
            entry[(tok + 1) % 100] = Logprob(-0.01, rank=1)
        logprobs.append(entry)
    return CompletionOutput(index, "", list(tokens), None, logprobs, routed, finish)


PROMPT = [1, 5, 6]  # P = 3


def joint_output():
    """Two samples (n=2) of lengths 4 and 2, routing [P + T - 1, M, K] uint8 as vLLM 0.32."""
    return RequestOutput(
        PROMPT,
        # Out of index order on purpose: records follow `index`.
        [
            completion(1, [9, 2], routed=routing(3 + 2 - 1, offset=10), finish="stop"),
            completion(0, [7, 8, 9, 10], routed=routing(3 + 4 - 1, offset=0), finish="length"),
        ],
    )


def convert(output, **kw):
    kw = {"prompt_id": "p0", "policy_version": 3, "sampler": "vllm-fp8", "n_experts": E,
          "moe_layers": M, "top_k": K, "created_at": 100.0} | kw
    return request_output_to_group(output, **kw)


def test_joint_layout_n2_sentinel_last_row():
    g = convert(joint_output())
    assert g.prompt_tokens.tolist() == PROMPT
    assert [r.tokens.tolist() for r in g.responses] == [[7, 8, 9, 10], [9, 2]]
    assert [r.finish_reason for r in g.responses] == ["length", "stop"]
    # sample 0: -0.5 - 0.1 s for s = 0..3; sample 1: -1.0 - 0.1 s for s = 0, 1.
    np.testing.assert_allclose(g.responses[0].logprobs, [-0.5, -0.6, -0.7, -0.8], rtol=1e-6)
    np.testing.assert_allclose(g.responses[1].logprobs, [-1.0, -1.1], rtol=1e-6)
    r0 = g.responses[0].routed_experts
    assert r0.shape == (3 + 4, M, K) and r0.dtype == np.int16
    # Rows 0..5 as returned; row 6 (the last sampled token, never fed forward) is -1.
    np.testing.assert_array_equal(r0[:6], routing(6, offset=0))
    assert (r0[6] == -1).all() and (r0[:6] >= 0).all()
    # Sample 1, token 0 of layer 1 slot 1: (10 + 0 + 2 + 1) % 8 = 5.
    assert g.responses[1].routed_experts[0, 1, 1] == 5
    assert (g.responses[1].routed_experts[4] == -1).all()
    assert g.n_experts == E and g.sampler == "vllm-fp8" and g.policy_version == 3
    assert records.decode(records.encode(g)) == g


def test_split_layout_prompt_routing_shared_by_samples():
    prompt_routed = routing(3, offset=5, dtype=np.int16)
    out = SplitRequestOutput(
        PROMPT,
        [
            completion(0, [4, 4, 4], routed=routing(2, offset=1, dtype=np.int16)),  # T - 1 rows
            completion(1, [6, 2], routed=routing(2, offset=2, dtype=np.int16)),  # T rows
        ],
        prompt_routed,
    )
    g = convert(out)
    r0, r1 = (r.routed_experts for r in g.responses)
    np.testing.assert_array_equal(r0[:3], prompt_routed)
    np.testing.assert_array_equal(r1[:3], prompt_routed)
    np.testing.assert_array_equal(r0[3:5], routing(2, offset=1))
    assert (r0[5] == -1).all()  # 3 generated tokens, 2 routed rows: the last is the sentinel
    np.testing.assert_array_equal(r1[3:], routing(2, offset=2))  # all 2 rows given: no sentinel
    assert (r1 >= 0).all()


def test_missing_routing_raises_with_hint():
    out = joint_output()
    out.outputs[1].routed_experts = None  # the index-0 sample
    with pytest.raises(RoutingMissingError, match=r"outputs\[0\].routed_experts is None.*"
                                                  r"enable_return_routed_experts=True"):
        convert(out)
    split = SplitRequestOutput(PROMPT, [completion(0, [4], routed=routing(0, 0))], None)
    with pytest.raises(RoutingMissingError, match="prompt_routed_experts is None"):
        convert(split)


def test_routing_optional_and_dense():
    out = joint_output()
    out.outputs[0].routed_experts = None
    g = convert(out, expect_routing=False)
    assert g.responses[0].routed_experts is not None  # index 0 kept its routing
    assert g.responses[1].routed_experts is None
    dense = convert(joint_output(), n_experts=None, expect_routing=False)
    assert all(r.routed_experts is None for r in dense.responses) and dense.n_experts is None
    with pytest.raises(VllmOutputError, match="needs n_experts"):
        convert(joint_output(), n_experts=None)


def test_wrong_routing_shapes_and_values():
    out = joint_output()
    out.outputs[1].routed_experts = routing(4, 0)  # P + T - 1 = 6 expected
    with pytest.raises(VllmOutputError, match=r"4 rows.*3-token prompt and 4 generated.*6"):
        convert(out)
    with pytest.raises(VllmOutputError, match=r"\[layers, top_k\] = \(2, 2\), expected \(3, 2\)"):
        convert(joint_output(), moe_layers=3)
    out = joint_output()
    out.outputs[0].routed_experts[0, 0, 0] = E  # expert 8 of 8 does not exist
    with pytest.raises(VllmOutputError, match=r"values \[0, 8\] outside \[0, n_experts=8\)"):
        convert(out)


def test_more_than_256_experts_uint16():
    # vLLM returns uint16 above 256 experts; records keep int16 ids (and int16 on disk).
    routed = np.array([[[300, 7]], [[299, 1]]], np.uint16)  # P + T - 1 = 2 rows, M = 1, K = 2
    out = RequestOutput([3, 4], [completion(0, [5], routed=routed)])
    g = convert(out, n_experts=320, moe_layers=1, top_k=2)
    assert g.responses[0].routed_experts.tolist() == [[[300, 7]], [[299, 1]], [[-1, -1]]]
    assert records.decode(records.encode(g)) == g


def test_logprobs_checks():
    g = convert(RequestOutput(PROMPT, [completion(0, [7, 8], routed=routing(4, 0),
                                                  extra_logprobs=True)]))
    np.testing.assert_allclose(g.responses[0].logprobs, [-0.5, -0.6], rtol=1e-6)  # sampled only
    out = joint_output()
    out.outputs[0].logprobs = None
    with pytest.raises(VllmOutputError, match=r"logprobs is None.*logprobs=0"):
        convert(out)
    out = joint_output()
    out.outputs[1].logprobs[2] = {99: Logprob(-1.0)}  # sample 0, step 2 sampled token 9
    with pytest.raises(VllmOutputError, match=r"outputs\[0\].logprobs\[2\].*sampled token 9"):
        convert(out)
    out = joint_output()
    out.outputs[0].logprobs.pop()
    with pytest.raises(VllmOutputError, match="1 log-prob positions for 2 sampled tokens"):
        convert(out)


def test_finish_reasons():
    out = joint_output()
    out.outputs[0].finish_reason = "repetition"
    assert convert(out).responses[1].finish_reason == "abort"
    for reason, message in ((None, "not finished"), ("error", "must be re-run")):
        out.outputs[0].finish_reason = reason
        with pytest.raises(VllmOutputError, match=message):
            convert(out)


def test_recorded_output_round_trip_through_json():
    for out in (joint_output(), SplitRequestOutput(
            PROMPT, [completion(0, [4], routed=routing(0, 0, np.int16))],
            routing(3, 1, np.int16))):
        d = json.loads(json.dumps(output_to_dict(out)))
        assert convert(output_from_dict(d)) == convert(out)


# ---- VllmSampler on recorded outputs (no vLLM) ---------------------------------------------------
class RecordedLLM:
    """`vllm.LLM` at its boundary: `generate` answers each prompt with a recorded output."""

    built: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        RecordedLLM.built.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(params)
        return [output_from_dict(RECORDED[tuple(p["prompt_token_ids"])]) for p in prompts]


# Request 0 (n=2): samples of 4 and 2 tokens; request 1 (n=1): one of 3.
RECORDED = {tuple(PROMPT): output_to_dict(joint_output()),
            (1, 4): output_to_dict(RequestOutput([1, 4], [
                completion(0, [6, 6, 2], routed=routing(2 + 3 - 1, offset=3))]))}


def published(tmp_path, version, hf=True):
    """A weights version dir (`buffer.weights` layout) whose hf/config.json is an M x K of E MoE."""
    path = tmp_path / f"v{version:08d}"
    (path / "hf").mkdir(parents=True)
    if hf:
        (path / "hf" / "config.json").write_text(json.dumps(
            {"num_experts": E, "num_experts_per_tok": K, "num_hidden_layers": M}))
    return path


def test_vllm_sampler_groups_seeds_and_reload(tmp_path, monkeypatch):
    import jax

    from espo_jax.models.presets import get_preset
    from espo_jax.rollout import vllm_worker
    from espo_jax.rollout.batching import Generation, Request
    from espo_jax.rollout.sampling import SamplingConfig

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        __version__="0.32.0", LLM=RecordedLLM, TokensPrompt=dict,
        SamplingParams=types.SimpleNamespace))
    monkeypatch.setattr(vllm_worker, "check_accelerator", lambda *a: None)  # routing on, no GPU
    monkeypatch.setattr(vllm_worker.VllmWorker, "_on_gpu", staticmethod(lambda: False))
    RecordedLLM.built = []
    logged = []
    sampler = vllm_worker.VllmSampler(vllm_worker.VllmWorkerConfig(
        n_samples=1, sampling=SamplingConfig(max_new_tokens=4, stop_tokens=(2,))),
        log=logged.append)
    model = get_preset("tiny")  # 2 MoE layers, top-2 of 8 experts: the hf/config.json's shape
    with pytest.raises(FileNotFoundError, match="version 1 at .* has no hf/ export.*hf_export"):
        sampler.load(1, published(tmp_path / "a", 1, hf=False), model)
    with pytest.raises(ValueError, match=r"\(8, \(0, 1\), 2\) but the version's config.json "
                                         r"\(8, \(0, 1\), 1\): a broken hf/ export"):
        sampler.load(1, published(tmp_path / "b", 1), model.replace(top_k=1))
    assert not RecordedLLM.built  # both refused before vLLM was asked for anything
    sampler.load(1, published(tmp_path, 1), model)
    assert (sampler.sampler_name, sampler.n_experts) == ("vllm-fp8", E)
    assert RecordedLLM.built[0].kwargs["enable_return_routed_experts"] is True

    requests = [Request("p0", PROMPT, n_samples=2), Request("p1", [1, 4], max_new_tokens=3)]
    rng = jax.random.key(7)
    seen = []
    groups = sampler.generate_groups(requests, rng=rng, admission="longest_first",
                                     on_group=seen.append)
    # One generate call, per-request n, budget and seed: fold_in(rng, i) -> an int31.
    (params,) = RecordedLLM.built[0].calls
    seeds = [int(jax.random.randint(jax.random.fold_in(rng, i), (), 0, 2**31 - 1))
             for i in range(2)]
    assert [(p.n, p.max_tokens, p.seed) for p in params] == [(2, 4, seeds[0]), (1, 3, seeds[1])]
    assert seeds[0] != seeds[1] and vllm_worker.request_seeds(rng, requests) == seeds
    assert vllm_worker.request_seeds(rng, [Request("x", [1], seed=1)]) == seeds[1:]
    assert seen == groups and [g.request_index for g in groups] == [0, 1]
    g0, g1 = groups
    assert g0.prompt_id == "p0" and g0.prompt_tokens.dtype == np.int32
    assert g0.prompt_tokens.tolist() == PROMPT and all(
        isinstance(r, Generation) for r in g0.responses)
    # The conversion of `request_output_to_group` (test_joint_layout_n2_sentinel_last_row).
    want = convert(joint_output()).responses
    for r, w in zip(g0.responses, want, strict=True):
        assert r.tokens.tolist() == w.tokens.tolist() and r.finish_reason == w.finish_reason
        np.testing.assert_array_equal(r.logprobs, w.logprobs)
        np.testing.assert_array_equal(r.routed_experts, w.routed_experts)
    assert g1.responses[0].routed_experts.shape == (2 + 3, M, K)
    assert sampler.last_stats["engine/abandoned_samples"] == 0.0
    assert sampler.last_stats["engine/generated_tokens"] == 4 + 2 + 3

    sampler.load(2, published(tmp_path, 2), model)  # on CPU "auto" rebuilds the LLM
    assert len(RecordedLLM.built) == 2 and logged[-1].startswith("[vllm_worker] weights v2: "
                                                                 "rebuild")
    assert RecordedLLM.built[1].kwargs["model"].endswith("v00000002/hf")
    with pytest.raises(VllmOutputError, match="1 completions for n=3 samples"):
        sampler.generate_groups([Request("p1", [1, 4], n_samples=3)], rng=rng)
    sampler.request_stop()  # a call that has not started returns nothing
    assert sampler.generate_groups(requests, rng=rng) == []
    assert len(RecordedLLM.built[1].calls) == 1


# ---- DeepSeek-V3 and GLM-4.5: dense first layers, vLLM's per-decoder-layer capture --------------
def family_config(family: str):
    """3 layers, the first dense (`first_k_dense_replace` = 1): MoE layers 1 and 2, top-2 of 8
    experts in 4 groups (2 searched), one shared expert; MLA for DeepSeek-V3, GQA with partial
    rotary, q/k norm and bias for GLM-4.5."""
    from espo_jax.models.presets import get_preset

    common = dict(n_layers=3, first_k_dense=1, router="sigmoid_group", n_group=4, topk_group=2,
                  n_shared_experts=1, routed_scaling_factor=2.5, aux_loss_coef=0.0)
    if family == "deepseek_v3":
        return get_preset("tiny", attention="mla", n_kv_heads=4, head_dim=8, q_lora_rank=24,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                          v_head_dim=16, rope_interleave=True, qk_norm=False, **common)
    return get_preset("tiny", head_dim=16, qk_norm=True, qkv_bias=True,
                      partial_rotary_factor=0.5, **common)


def with_correction_bias(params, seed: int = 1):
    """Every MoE layer's e_score_correction_bias drawn N(0, 0.5): it changes the choices."""
    import jax

    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: 0.5 * jax.random.normal(next(keys), x.shape, x.dtype)
        if getattr(path[-1], "key", None) == "e_score_correction_bias" else x, params)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_families_export_and_routing_with_dense_layers(tmp_path, monkeypatch, family):
    import jax

    from espo_jax import models
    from espo_jax.buffer import weights
    from espo_jax.models import hf_io
    from espo_jax.rollout import vllm_worker
    from espo_jax.rollout.engine import Engine, Request
    from espo_jax.rollout.mismatch import measure_mismatch
    from espo_jax.rollout.sampling import SamplingConfig

    config = family_config(family)
    assert config.moe_layers == (1, 2)
    params = jax.device_get(with_correction_bias(models.init_params(config, jax.random.key(0))))
    path = weights.publish(tmp_path / "weights", 1, config, params,
                           hf_export=hf_io.exporter(config, params), keep=None)
    hf_dir = vllm_worker.hf_export_dir(1, path)
    hf = json.loads(open(f"{hf_dir}/config.json").read())
    assert (hf["model_type"], hf["first_k_dense_replace"], hf["n_routed_experts"]) == (
        family, 1, 8)
    # vLLM's rule (deepseek_v2.py / glm4_moe.py): layer i is MoE when i >= first_k_dense_replace.
    assert vllm_worker.moe_shape(hf_dir) == vllm_worker.MoeShape(8, 2, 2, (1, 2))

    # The embedded engine (fp32) stands in for vLLM: its groups in vLLM 0.32's layout, routing
    # [P + T - 1, num_hidden_layers = 3, k] with the dense layer 0's column left 0.
    engine = Engine(config, params, sampling=SamplingConfig(max_new_tokens=5), max_slots=4,
                    max_cache_len=32)
    prompts = {"p0": [1, 5, 6, 7], "p1": [1, 9, 4]}
    ref = engine.generate_groups([Request(k, v) for k, v in prompts.items()], n_samples=2,
                                 rng=jax.random.key(3))
    recorded = {}
    for g in ref:
        p = len(g.prompt_tokens)
        outs = []
        for i, r in enumerate(g.responses):
            n = p + len(r.tokens) - 1
            full = np.zeros((n, 3, 2), np.uint8)
            full[:, 1:] = r.routed_experts[:n]
            outs.append(CompletionOutput(
                i, "", r.tokens.tolist(), None,
                [{int(t): Logprob(float(lp))} for t, lp in zip(r.tokens, r.logprobs, strict=True)],
                full, r.finish_reason))
        recorded[tuple(g.prompt_tokens.tolist())] = output_to_dict(
            RequestOutput(g.prompt_tokens.tolist(), outs))
    monkeypatch.setattr(sys.modules[__name__], "RECORDED", recorded)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        __version__="0.32.0", LLM=RecordedLLM, TokensPrompt=dict,
        SamplingParams=types.SimpleNamespace))
    monkeypatch.setattr(vllm_worker, "check_accelerator", lambda *a: None)
    monkeypatch.setattr(vllm_worker.VllmWorker, "_on_gpu", staticmethod(lambda: False))
    sampler = vllm_worker.VllmSampler(vllm_worker.VllmWorkerConfig(
        n_samples=2, sampling=SamplingConfig(max_new_tokens=5)))
    sampler.load(1, path, config)
    got = sampler.generate_groups([Request(k, v) for k, v in prompts.items()],
                                  rng=jax.random.key(0))
    groups = []
    for g, want in zip(got, ref, strict=True):
        for r, w in zip(g.responses, want.responses, strict=True):
            # The M = 2 axis of the MoE layers, as the engine recorded it (its last row -1).
            assert r.routed_experts.shape == (len(want.prompt_tokens) + len(w.tokens), 2, 2)
            np.testing.assert_array_equal(r.routed_experts, w.routed_experts)
        groups.append(request_output_to_group(
            output_from_dict(recorded[tuple(g.prompt_tokens.tolist())]), prompt_id=g.prompt_id,
            policy_version=1, sampler="vllm-fp32", n_experts=8, moe_layers=2, top_k=2,
            moe_layer_ids=(1, 2)))
    # Replaying the recorded routing, the learner reproduces the sampler's log-probs.
    m = measure_mismatch(config, params, groups, replay=True)
    assert m["mismatch/logp_abs_max"] < 1e-4 and m["moe/routing_flip_rate"] == 0.0

    bad = recorded[tuple(prompts["p1"])]
    bad["outputs"][0]["routed_experts"]["values"][0] = 3  # token 0, dense layer 0, slot 0
    with pytest.raises(VllmOutputError, match=r"expert ids in decoder layers \[0\], which "
                                              r"the model's config makes dense "
                                              r"\(MoE layers: \[1, 2\]\)"):
        convert(output_from_dict(bad), moe_layers=2, moe_layer_ids=(1, 2))
    with pytest.raises(VllmOutputError, match=r"has 3 layer columns: neither one per MoE "
                                              r"layer \(2\) nor one per decoder layer "
                                              r"holding the MoE layers \[1, 3\]"):
        convert(output_from_dict(bad), moe_layers=2, moe_layer_ids=(1, 3))
