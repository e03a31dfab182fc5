"""GGUF checkpoints (llama.cpp's format) -> Hugging Face directories that `hf_io` reads.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=...)`, through the `gguf`
package), dequantising every tensor to fp32 and rebuilding the tokenizer, its special tokens and
chat template from the file's metadata. A GGUF-loaded model refuses `save_pretrained`; its state
dict copied into a fresh model of the same config (without `quantization_config`) saves a normal
safetensors directory. The result is the dequantised model: the same numbers llama.cpp computes
with, in fp32.

    python -m espo_jax.models.gguf SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2
"""

from __future__ import annotations

import os
import sys

from espo_jax.models import hf_io


def convert(gguf_path: str, out_dir: str) -> str:
    """Writes the model and tokenizer of `gguf_path` to `out_dir` (config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json, chat template) and returns it.
    An architecture `hf_io` cannot read is an error before any tensor is dequantised."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    directory, name = os.path.split(os.path.abspath(gguf_path))
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if config.model_type not in hf_io.ARCHITECTURES:
        raise ValueError(f"{gguf_path}: model_type {config.model_type!r} is not one hf_io "
                         f"reads ({sorted(hf_io.ARCHITECTURES)})")
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m espo_jax.models.gguf FILE.gguf OUT_DIR")
    print(convert(sys.argv[1], sys.argv[2]))
