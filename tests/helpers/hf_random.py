"""Random transformers checkpoints for the parity tests of each model family: one saved model per
case (its own seed, the family's own randomisation of the weights) and transformers' eager fp32
forward of it, shared by tests/models/test_hf_io.py, test_deepseek_glm.py and test_qwen3_next.py."""

import os
from collections.abc import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


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


def eager_forward(path: str, tokens: np.ndarray, router_logits: bool = True):
    """(model, output) of transformers' eager fp32 forward of the checkpoint at `path`."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                 dtype=torch.float32)
    model.eval()
    moe = {"output_router_logits": True} if router_logits else {}
    with torch.no_grad():
        return model, model(torch.as_tensor(tokens), **moe)
