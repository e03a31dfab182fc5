"""Hugging Face interop: read and write Qwen3-MoE / Qwen2-MoE checkpoint directories, the
dense families beside them (Qwen3, Qwen2, Llama: SmolLM2, Llama 2/3 without RoPE scaling), and
DeepSeek-V3 / GLM-4.5 (multi-token-prediction layers skipped on read). config.json is
translated by `hf_config` (and `hf_deepseek`), tensor names and shapes by `hf_param_map`; this
module moves the tensors.

A Hugging Face directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. `from_pretrained` turns one into `(ModelConfig, params)` in the
parameter tree of `espo_jax.models` (the model contract); `save_pretrained` writes the reverse,
which `transformers.AutoModelForCausalLM.from_pretrained` and vLLM load.

Conventions crossed here:
- HF `nn.Linear` weights are [out, in]; our kernels are [in, out] (transposed both ways).
- Experts are separate tensors on disk, `mlp.experts.{j}.{gate,up,down}_proj.weight` (what
  transformers 5.x `save_pretrained` writes and vLLM expects); we stack them into `wi_gate`,
  `wi_up` [E, D, F] and `wo` [E, F, D]. The fused in-memory layout of transformers 5.x
  (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]) is also read.
- Tensors are read one at a time (`safe_open`), so a checkpoint never needs twice its size in
  host memory; pass `shardings` to place each parameter on devices as soon as it is built.
- Block-FP8 checkpoints (DeepSeek-V3's `quantization_config`, `weight_scale_inv` tensors) are
  read dequantised, each E4M3 value times its block's scale (`espo_jax.models.hf_fp8`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from espo_jax.models import hf_fp8, hf_param_map, hf_qwen3_next, scan
from espo_jax.models.config import ModelConfig
from espo_jax.models.hf_config import (  # noqa: F401  (re-exported)
    _NP_DTYPES,
    ARCHITECTURES,
    DENSE,
    config_from_hf,
    config_to_hf,
)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
log = logging.getLogger(__name__)


# ---- reading -------------------------------------------------------------------------------------
class _TensorReader:
    """Tensors of a checkpoint directory by name, one at a time, opening shards lazily; a
    block-FP8 weight comes dequantised (float32) with `fp8_block` (rows, cols) blocks."""

    def __init__(self, path: str, fp8_block: tuple[int, int] | None = None):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            with safe_open(os.path.join(path, SINGLE_FILE), framework="numpy") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
        self.path, self.weight_map, self.used = path, weight_map, set()
        self.fp8_block = fp8_block
        self._files: dict[str, Any] = {}
        self._headers: dict[str, dict] = {}  # safetensors headers, for E4M3 tensors

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from its file's header (no data read)."""
        with safe_open(os.path.join(self.path, self.weight_map[name]), framework="numpy") as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        value, scale = self._read(name), hf_fp8.scale_name(name)
        if value.dtype == hf_fp8.E4M3 or scale in self.weight_map:
            scale_inv = self._read(scale) if scale in self.weight_map else None
            value = hf_fp8.dequantize(name, value, scale_inv, self.fp8_block)
        return value

    def _read(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise KeyError(name)
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(os.path.join(self.path, file), framework="numpy")
        self.used.add(name)
        if self._files[file].get_slice(name).get_dtype() != hf_fp8.SAFETENSORS_E4M3:
            return self._files[file].get_tensor(name)
        if file not in self._headers:
            self._headers[file] = hf_fp8.read_header(os.path.join(self.path, file))
        return hf_fp8.read_e4m3(os.path.join(self.path, file), name, self._headers[file])


def _fused_getter(reader: _TensorReader, config: ModelConfig) -> hf_param_map.Getter:
    """Serves per-expert names from the fused transformers 5.x layout when a file uses it."""
    f = config.d_expert
    last: dict[str, np.ndarray] = {}  # the fused tensor being split (read once, not E times)

    def fused(name: str) -> np.ndarray:
        if name not in last:
            last.clear()
            last[name] = reader.get(name)
        return last[name]

    def get(name: str) -> np.ndarray:
        if name in reader:
            return reader.get(name)
        parts = name.split(".")  # {model.}layers.{i}.mlp.experts.{j}.{proj}.weight
        if len(parts) >= 8 and parts[-4] == "experts":
            base, j, proj = ".".join(parts[:-3]), int(parts[-3]), parts[-2]
            if proj in ("gate_proj", "up_proj") and base + ".gate_up_proj" in reader:
                gate_up = fused(base + ".gate_up_proj")[j]  # [2F, D]
                return gate_up[:f] if proj == "gate_proj" else gate_up[f:]
            if proj == "down_proj" and base + ".down_proj" in reader:
                return fused(base + ".down_proj")[j]  # [D, F]
        raise KeyError(name)

    return get


def from_pretrained(path: str, *, dtype: str | None = None, shardings: Any = None,
                    strict: bool = True) -> tuple[ModelConfig, dict]:
    """Reads a Hugging Face directory (one of `ARCHITECTURES`) into `(config, params)`.

    dtype: parameter dtype ("float32", "bfloat16", "float16"); default: config.json's `dtype`.
      Block-FP8 weights are dequantised exactly in float32, then cast to it.
    shardings: optional pytree of `jax.sharding.Sharding` shaped like params; each parameter is
      placed with `jax.device_put` as soon as it is built (no full host copy of the model).
      Without it the leaves are host numpy arrays (jit accepts them).
    strict: raise if the checkpoint holds tensors the model does not use.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cfg_path) as f:
        hf = json.load(f)
    config = config_from_hf(hf, dtype=dtype)
    np_dtype = _NP_DTYPES[config.param_dtype]
    reader = _TensorReader(path, hf_fp8.block_size(hf))
    prefix = hf_qwen3_next.tensor_prefix(hf)  # the text model's, in a multimodal checkpoint
    rename = (lambda n: prefix + n[len("model."):] if n.startswith("model.") else n)
    for name in (rename("model.embed_tokens.weight"), "lm_head.weight"):  # before any read
        rows = reader.shape(name)[0] if name in reader else config.vocab_size
        if rows != config.vocab_size:
            raise ValueError(f"checkpoint {path}: {name} has {rows} vocabulary rows but "
                             f"config.json's vocab_size is {config.vocab_size}")
    fused_get = _fused_getter(reader, config)
    get = lambda name: fused_get(rename(name))
    params: dict = {}
    expected = hf_param_map.expected_shapes(config)
    text_type = hf_qwen3_next.text_config(hf).get("model_type", "")
    for ours, names, _, from_hf in hf_param_map.param_map(config, text_type):
        names = [rename(n) for n in names]
        try:
            tree = from_hf(get)
        except KeyError as e:
            missing = [n for n in names if n not in reader]
            raise ValueError(f"checkpoint {path} lacks tensor {e.args[0]} (for params "
                             f"{'/'.join(ours)}; {len(missing)} of its {len(names)} HF tensors "
                             "missing)") from None
        for leaf, value in hf_param_map.leaves_of(ours, tree):
            if value.shape != expected[leaf]:
                raise ValueError(f"tensor(s) {names[0]}{'...' if len(names) > 1 else ''} give "
                                 f"{'/'.join(leaf)} shape {value.shape}; config implies "
                                 f"{expected[leaf]}")
            # the correction bias stays fp32 (it orders experts whose scores may differ by
            # < 1e-3)
            value = np.ascontiguousarray(value.astype(
                np.float32 if leaf[-1] == "e_score_correction_bias" else np_dtype))
            if shardings is not None:
                import jax

                value = jax.device_put(value, hf_param_map.get_leaf(shardings, leaf))
            hf_param_map.set_leaf(params, leaf, value)
    skipped = sorted(n for n in reader.weight_map if n.startswith(hf_qwen3_next.SKIPPED_PREFIXES))
    if skipped:
        log.info("%s: skipped %d multi-token-prediction / vision tensors (%s...)", path,
                 len(skipped), skipped[0])
    n_mtp = hf.get("num_nextn_predict_layers") or 0
    mtp = {n for n in reader.weight_map if (m := _LAYER_INDEX.match(n))
           and config.n_layers <= int(m.group(1)) < config.n_layers + n_mtp}
    if mtp:
        log.info("%s: skipped %d tensors of %d multi-token-prediction layers (layers %d..%d; "
                 "speculative decoding, not the policy)", path, len(mtp), n_mtp,
                 config.n_layers, config.n_layers + n_mtp - 1)
    unused = sorted(n for n in reader.weight_map if n not in reader.used
                    and not n.endswith(_IGNORED_SUFFIXES) and n not in mtp
                    and not n.startswith(hf_qwen3_next.SKIPPED_PREFIXES)
                    and not (config.tie_embeddings and n == "lm_head.weight"))
    if strict and unused:
        raise ValueError(f"checkpoint {path} has {len(unused)} tensors the model does not use, "
                         f"e.g. {unused[:5]} (pass strict=False to ignore them)")
    return config, params


# ---- writing -------------------------------------------------------------------------------------
def _hf_tensors(config: ModelConfig, params: dict, np_dtype: Any,
                model_type: str) -> Iterator[tuple[str, np.ndarray]]:
    expected = hf_param_map.expected_shapes(config)
    for ours, names, to_hf, _ in hf_param_map.param_map(config, model_type):
        value = hf_param_map.get_leaf(params, ours)
        if ours[-1] == "linear_attn":  # a Gated DeltaNet subtree
            for leaf, array in hf_param_map.leaves_of(ours, value):
                if leaf not in expected or np.shape(array) != expected[leaf]:
                    raise ValueError(f"params {'/'.join(leaf)} has shape {np.shape(array)}; "
                                     f"config implies {expected.get(leaf, 'no such leaf')}")
            for name, array in zip(names, to_hf(value), strict=True):
                yield name, np.ascontiguousarray(np.asarray(array).astype(np_dtype))
            continue
        if isinstance(value, dict):
            raise ValueError(f"params {'/'.join(ours)} is a quantised kernel {sorted(value)}; "
                             "write float weights (quant.dequantize_params(params) first)")
        value = np.asarray(value)
        if value.shape != expected[ours]:
            raise ValueError(f"params {'/'.join(ours)} has shape {value.shape}; config implies "
                             f"{expected[ours]}")
        for name, array in zip(names, to_hf(value), strict=True):
            yield name, np.ascontiguousarray(array.astype(np_dtype))


def save_pretrained(config: ModelConfig, params: dict, path: str, *, dtype: str | None = None,
                    max_shard_bytes: int = 5 * 2**30,
                    extra_config: dict[str, Any] | None = None,
                    model_type: str | None = None) -> list[str]:
    """Writes config.json + safetensors (per-expert tensor names) for transformers and vLLM.

    model_type: the family to write, the checkpoint's the model was read from
    (`source_model_type`): a Qwen3.5-MoE model exports as `qwen3_5_moe_text` (its text model;
    a multimodal checkpoint's vision tower and multi-token-prediction layers, skipped on read,
    are not written), else the family `config` implies.

    dtype: tensor dtype on disk (default `config.param_dtype`). Above `max_shard_bytes` the
    tensors go into `model-0000i-of-0000n.safetensors` shards with `model.safetensors.index.json`.
    extra_config: merged into config.json (e.g. `eos_token_id`, `bos_token_id`).
    Earlier `model*.safetensors` files in `path` are removed first. Returns the files written.
    """
    dtype = dtype or config.param_dtype
    params, config = scan.unstack(params), config.replace(scan_layers=False)
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_NP_DTYPES)}")
    hf = config_to_hf(config, dtype=dtype, model_type=model_type) | (extra_config or {})
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(path, name))
    # Shards are written as they fill (one shard in memory at a time) under temporary names,
    # renamed once their count is known.
    shard: dict[str, np.ndarray] = {}
    tmp_files: list[str] = []
    shard_of: dict[str, int] = {}
    size = total = 0

    def flush() -> None:
        tmp_files.append(os.path.join(path, f".model-tmp-{len(tmp_files):05d}.safetensors"))
        save_file(shard, tmp_files[-1], metadata={"format": "pt"})
        shard.clear()

    for name, array in _hf_tensors(config, params, _NP_DTYPES[dtype], hf["model_type"]):
        if shard and size + array.nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = array
        shard_of[name] = len(tmp_files)
        size += array.nbytes
        total += array.nbytes
    flush()
    n = len(tmp_files)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                          for i in range(n)]
    for tmp, file in zip(tmp_files, files, strict=True):
        os.replace(tmp, os.path.join(path, file))
    if n > 1:
        weight_map = {name: files[i] for name, i in shard_of.items()}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(INDEX_FILE)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    return files + ["config.json"]


def source_model_type(path: str) -> str | None:
    """The `model_type` of the text model a Hugging Face directory holds (a `qwen3_5_moe`
    checkpoint's `text_config`'s), None without a config.json: what `save_pretrained` writes
    back."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json")) as f:
        return hf_qwen3_next.text_config(json.load(f)).get("model_type")


def exporter(config: ModelConfig, params: dict, **kwargs: Any) -> Callable[[str], None]:
    """`path -> save_pretrained(config, params, path, **kwargs)`: the Hugging Face export of a
    published weights version (`espo_jax.buffer.weights.publish(..., hf_export=...)`)."""
    return lambda path: save_pretrained(config, params, path, **kwargs)
