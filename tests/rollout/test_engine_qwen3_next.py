"""The embedded engine on Qwen3-Next (Gated DeltaNet + gated attention): greedy decoding equals
transformers' `generate` token for token on a tiny random model; per slot it keeps each linear
layer's conv windows and recurrent state and a KV cache for the full-attention layer; the
captured routing equals the learner's own routing of the same sequence."""

import functools

import jax
import numpy as np
import pytest
import torch
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
    forward = jax.jit(functools.partial(models.forward, config))
    for g in engine.generate_groups(requests, n_samples=1):
        prompt = torch.as_tensor(np.asarray(g.prompt_tokens))[None]
        with torch.no_grad():
            hf = model.generate(prompt, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                                eos_token_id=None, pad_token_id=0)
        r = g.responses[0]
        np.testing.assert_array_equal(r.tokens, hf[0, prompt.shape[1]:].numpy())
        seq = np.concatenate([g.prompt_tokens, r.tokens])[None]
        out = forward(params, seq)
        assert r.routed_experts.shape == (seq.shape[1], 3, 2) == out.routed_experts.shape[1:]
        np.testing.assert_array_equal(r.routed_experts[:-1], np.asarray(out.routed_experts[0])[:-1])
    # per slot: layers 0 and 2 hold 3 conv inputs of q, k (16 each) and v (24) plus the
    # 4 x 8 x 6 fp32 state; layer 1 keys and values of 2 heads x 16 per cache slot (fp32)
    cache = models.init_cache(config, 1, 32)
    per_slot = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert per_slot == 2 * (4 * 3 * (16 + 16 + 24) + 4 * 4 * 8 * 6) + 4 * 2 * 2 * 16 * 32
