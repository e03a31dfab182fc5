"""Block-FP8 Hugging Face checkpoints (DeepSeek-V3's published format), read as float weights.

config.json carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`. Each quantised Linear weight
`X.weight` is float8_e4m3fn [..., out, in] beside `X.weight_scale_inv` float32
[..., ceil(out/b0), ceil(in/b1)] (a fused tensor `X` beside `X_scale_inv`, as transformers
names them); the weight is `float32(X.weight) * scale_inv` of its block, blocks starting at
index 0 and the last ones partial. Modules left in high precision (embeddings, norms, the
router gate, lm_head: transformers' `modules_to_not_convert`) simply have no scale tensor.

`dequantize` computes that product exactly (one float32 multiply per element) with the block
size config.json names (transformers' `Fp8Dequantize` derives it as rows / grid rows, which is
not the block when an edge block is partial). Our [in, out] kernels are the transposes, whose
block grids are the transposed grids: with 128x128 blocks, `espo_jax.models.quant`'s block
scheme is this format.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
SAFETENSORS_E4M3 = "F8_E4M3"  # the safetensors dtype name


def block_size(hf: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) weight block of config.json's `quantization_config`; None when the
    checkpoint is not quantised. Any other format is refused by name."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; only "
                         "'fp8' (E4M3 weights with block scales, DeepSeek-V3's format)")
    wrong = [(key, q[key], ok) for key, ok in (("fmt", "e4m3"), ("activation_scheme", "dynamic"),
                                               ("scale_fmt", "float"), ("expert_dtype", "fp8"))
             if q.get(key, ok) != ok]
    if wrong:
        raise ValueError("unsupported fp8 quantization_config: " + "; ".join(
            f"{key}={value!r} (only {ok!r})" for key, value, ok in wrong))
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 quantization_config.weight_block_size {block!r} is not two "
                         "positive integers (per-tensor FP8 scales are not supported)")
    return int(block[0]), int(block[1])


def scale_name(name: str) -> str:
    """The scale tensor that goes with weight tensor `name` (transformers' naming)."""
    return name.removesuffix(".weight") + ".weight_scale_inv" if name.endswith(".weight") \
        else name + "_scale_inv"


def read_e4m3(path: str, name: str, header: dict[str, Any]) -> np.ndarray:
    """Tensor `name` of safetensors file `path` (whose parsed header is `header`, see
    `read_header`) as a float8_e4m3fn array (safetensors' numpy reader lacks that dtype)."""
    info = header["tensors"][name]
    begin, end = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(header["data_start"] + begin)
        data = np.frombuffer(f.read(end - begin), np.uint8)
    return data.view(E4M3).reshape(info["shape"])


def read_header(path: str) -> dict[str, Any]:
    """The tensor table of safetensors file `path` and where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        tensors = json.loads(f.read(n))
    tensors.pop("__metadata__", None)
    return {"tensors": tensors, "data_start": 8 + n}


def dequantize(name: str, weight: np.ndarray, scale_inv: np.ndarray | None,
               block: tuple[int, int] | None) -> np.ndarray:
    """float32 `weight * scale_inv` of its block, checked: E4M3 values, a float scale grid of
    shape [..., ceil(rows/b0), ceil(cols/b1)], and a `quantization_config` that names the
    block."""
    if weight.dtype != E4M3:
        raise ValueError(f"tensor {name} has a scale tensor {scale_name(name)} but dtype "
                         f"{weight.dtype}; block-scaled weights are float8_e4m3fn")
    if scale_inv is None:
        raise ValueError(f"float8_e4m3fn tensor {name} has no scale tensor {scale_name(name)}")
    if block is None:
        raise ValueError(f"tensor {name} is float8_e4m3fn with block scales but config.json has "
                         "no quantization_config")
    if weight.ndim < 2:
        raise ValueError(f"float8_e4m3fn tensor {name} has shape {weight.shape}; block scales "
                         "need [..., out, in]")
    (rows, cols), (b0, b1) = weight.shape[-2:], block
    grid = weight.shape[:-2] + (-(-rows // b0), -(-cols // b1))
    if scale_inv.shape != grid or not np.issubdtype(scale_inv.dtype, np.floating):
        raise ValueError(f"scale tensor {scale_name(name)} is {scale_inv.dtype} {scale_inv.shape}; "
                         f"weight {weight.shape} in {b0}x{b1} blocks needs float {grid}")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, -2), b1, -1)
    return weight.astype(np.float32) * scale[..., :rows, :cols]
