"""The embedded engine on Qwen3-Next (Gated DeltaNet + gated attention): greedy decoding equals
transformers' `generate` token for token on a tiny random model; per slot it keeps each linear
layer's conv windows and recurrent state and a KV cache for the full-attention layer; the
captured routing equals the learner's own routing of the same sequence."""

import functools

import jax
import numpy as np
import pytest
import torch
from helpers.hf_random import assert_greedy_is_generate
from transformers import AutoModelForCausalLM, Qwen3NextConfig

from espo_jax import models
from espo_jax.models import hf_io
from espo_jax.rollout import engine as engine_lib
from espo_jax.rollout.sampling import SamplingConfig

NEW = 8
HF = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16,
          shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
          linear_value_head_dim=6, linear_conv_kernel_dim=4, max_position_embeddings=64,
          layer_types=["linear_attention", "full_attention", "linear_attention"])


@pytest.mark.slow  # ~80 s: prefill and decode compiles of the engine
def test_greedy_equals_transformers_generate(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3NextConfig(**HF), attn_implementation="eager",
                                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if "linear_attn" in name else 0.0))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p) - 1.0)
            else:
                p.copy_(torch.randn_like(p) if name.endswith("mlp.gate.weight")
                         else 0.3 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(str(tmp_path))
    config, params = hf_io.from_pretrained(str(tmp_path))
    config = config.replace(linear_chunk=4)  # prompts of 6 and 9 tokens span chunks
    engine = engine_lib.Engine(config, params, sampling=SamplingConfig(temperature=0.0,
                                                                       max_new_tokens=NEW),
                               max_slots=2, max_cache_len=32, steps_per_sync=4)
    rng = np.random.default_rng(1)
    requests = [engine_lib.Request(f"p{i}", rng.integers(0, 96, n).tolist())
                for i, n in enumerate((6, 9, 7))]
    groups = engine.generate_groups(requests, n_samples=1)
    assert_greedy_is_generate(model, config, params, groups, NEW,
                              jax.jit(functools.partial(models.forward, config)))
    # per slot: layers 0 and 2 hold 3 conv inputs of q, k (16 each) and v (24) plus the
    # 4 x 8 x 6 fp32 state; layer 1 keys and values of 2 heads x 16 per cache slot (fp32)
    cache = models.init_cache(config, 1, 32)
    per_slot = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert per_slot == 2 * (4 * 3 * (16 + 16 + 24) + 4 * 4 * 8 * 6) + 4 * 2 * 2 * 16 * 32


@pytest.mark.slow  # ~60 s: two engines' compiles and the learner's forwards
def test_router_replay_lowers_the_mismatch_of_a_bf16_engine():
    """The train-inference mismatch on the tiny Qwen3.5-MoE (experts x4, so that bf16 noise
    flips routes): an fp32 engine matches the fp32 learner to rounding; a bf16 engine's
    log-probs differ, most at the tokens whose routing flipped, and replaying the engine's
    routing (R3) removes that part (2026-12-05, 2-core AMD EPYC: mean |dlogp| 8.9e-3 -> 2.1e-3,
    at flips 9.2e-2 -> 2.2e-3; FP8 weights 2.8e-2 -> 1.2e-2)."""
    from espo_jax.bench.engine import _scale_experts
    from espo_jax.rollout import mismatch

    config = models.get_preset("tiny_qwen35_moe")
    params = jax.device_get(jax.jit(models.init_params, static_argnums=0)(config,
                                                                          jax.random.key(0)))
    params = _scale_experts(params, 4.0)
    rng = np.random.default_rng(0)
    requests = [engine_lib.Request(f"m{i}", rng.integers(0, config.vocab_size, 8).tolist())
                for i in range(8)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24)
    got = {}
    for precision in ("fp32", "bf16"):
        engine = engine_lib.Engine(config, params, sampling=sampling, max_slots=16,
                                   max_cache_len=64, precision=precision, steps_per_sync=8)
        groups = list(engine.generate_groups(requests, n_samples=4, rng=jax.random.key(7)))
        got[precision] = {replay: mismatch.measure_mismatch(config, params, groups, replay)
                          for replay in (False, True)}
    fp32, bf16 = got["fp32"], got["bf16"]
    assert fp32[False]["mismatch/tokens"] == 8 * 4 * 24
    assert fp32[False]["mismatch/logp_abs_mean"] < 1e-5
    assert fp32[False]["moe/routing_flip_rate"] == 0.0
    plain, replay = bf16[False], bf16[True]
    assert plain["moe/routing_flip_rate"] > 0.01  # bf16 flips routes at this scale
    assert plain["mismatch/logp_abs_mean_at_flips"] > 3 * plain["mismatch/logp_abs_mean_elsewhere"]
    assert replay["mismatch/logp_abs_mean"] < plain["mismatch/logp_abs_mean"] / 2
    assert replay["mismatch/logp_abs_mean_at_flips"] < plain["mismatch/logp_abs_mean_at_flips"] / 4
