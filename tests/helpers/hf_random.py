"""Random transformers checkpoints for the parity tests of each model family: one saved model per
case (its own seed, the family's own randomisation of the weights) and transformers' eager fp32
forward of it, shared by tests/models/test_hf_io.py, test_deepseek_glm.py and test_qwen3_next.py;
the engine's greedy decoding and routing against them (tests/rollout/test_engine_*.py)."""

import os
from collections.abc import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def randomize(model: torch.nn.Module, norm_centre: Callable[[str], float] = lambda _: 1.0,
              rules: tuple = ()) -> None:
    """Every weight of `model` random, N(0, 0.15^2), but: norms `norm_centre(name)` +
    N(0, 0.2^2) (HF's init leaves norms at 1 and biases at 0, which would hide a swapped
    mapping), router weights N(0, 1) (top-k choices with clear margins), and first the family's
    `rules`, ((name suffixes), (scale, shift)): N(shift, scale^2), buffers named by one too."""
    def by_rule(name: str, x: torch.Tensor) -> bool:
        for suffixes, (scale, shift) in rules:
            if name.endswith(suffixes):
                x.copy_(scale * torch.randn_like(x) + shift)
                return True
        return False

    with torch.no_grad():
        for name, p in model.named_parameters():
            if by_rule(name, p):
                continue
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p) + norm_centre(name))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            by_rule(name, buf)


def save_random(config: PretrainedConfig, randomize: Callable, root: str, case: str) -> str:
    """`config`'s model, seeded by the case name, its weights set by `randomize(model)`, saved
    under `root/case`; returns the path."""
    torch.manual_seed(sum(map(ord, case)))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32)
    randomize(model)
    path = os.path.join(root, case)
    model.save_pretrained(path)
    return path


def assert_greedy_is_generate(model, config, params, groups, new_tokens: int,
                              forward: Callable) -> None:
    """Each group's first response (the engine's greedy `new_tokens` tokens, no stop token)
    equals transformers' greedy `generate` of its prompt with `model`, token for token, and the
    routing it recorded equals the learner's (`forward(params, tokens)`) on the prompt and
    response at every position but the last (its token was never fed back)."""
    for g in groups:
        prompt = torch.as_tensor(np.asarray(g.prompt_tokens))[None]
        with torch.no_grad():
            hf = model.generate(prompt, do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        r = g.responses[0]
        np.testing.assert_array_equal(r.tokens, hf[0, prompt.shape[1]:].numpy())
        seq = np.concatenate([g.prompt_tokens, r.tokens])[None]
        out = forward(params, seq)
        shape = (seq.shape[1], config.n_moe_layers, config.top_k)  # MoE layers only
        assert r.routed_experts.shape == shape == out.routed_experts.shape[1:]
        np.testing.assert_array_equal(r.routed_experts[:-1], np.asarray(out.routed_experts[0])[:-1])


def eager_forward(path: str, tokens: np.ndarray, router_logits: bool = True):
    """(model, output) of transformers' eager fp32 forward of the checkpoint at `path`."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                 dtype=torch.float32)
    model.eval()
    moe = {"output_router_logits": True} if router_logits else {}
    with torch.no_grad():
        return model, model(torch.as_tensor(tokens), **moe)
