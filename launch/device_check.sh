#!/usr/bin/env bash
# The accelerator check: what espo_jax does on one GPU (or TPU), in under 8 minutes, on a bare
# JAX image with no network (JAX 0.10 or 0.11 with its accelerator plugin, flax, optax,
# orbax-checkpoint, torch, transformers, numpy, safetensors, tokenizers, msgpack, etils,
# absl-py, pyarrow). The packages espo_jax needs beyond those travel with the working tree as
# wheels (launch/device_wheels.sh fetches them into .device_wheels/, ~4 MiB) and are installed
# here, only those that do not import, with `pip install --no-index --no-deps --target` into a
# directory of their own put first on PYTHONPATH: nothing in the image's Python changes, no
# venv or ensurepip is needed, and where pip itself is missing the wheels (zip files) are
# unpacked instead.
#
# Sections (espo_jax/bench/device_check.py, each in its own process under a timeout, all under
# one budget): bf16 matmul peak; the learner's RL update (packing, R3 replay, ESPO, bf16) on a
# ~1B / 0.2B-active Qwen3-MoE per MoE dispatch and attention implementation, and on the
# DeepSeek-V3 family; engine decode tokens/s at 64 / 256 slots with fp32, bf16 and FP8 weights
# and the share of the HBM bound; bf16 engine vs bf16 learner mismatch with and without router
# replay; a ~1 minute pytest subset on the device. Prints tables and writes one JSON.
#
# Usage:  launch/device_check.sh [--dry_run] [OUT.json]
#   OUT.json   default $OUT/device_check.json where $OUT is set, else /tmp/device_check.json
#   --dry_run  the same code on the CPU at tiny sizes (CI: tests/bench/test_device_check.py)
# BUDGET_S=seconds (default 450; the dry run's 600), PYTHON=interpreter.
# For vLLM (FP8 rollouts, routing capture) on a GPU machine of your own: launch/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DRY=()
JSON=""
for arg in "$@"; do
  case "$arg" in
    --dry_run) DRY=(--dry_run) ;;
    -*) echo "usage: $0 [--dry_run] [OUT.json]" >&2; exit 2 ;;
    *) JSON=$arg ;;
  esac
done
JSON=${JSON:-${OUT:-/tmp}/device_check.json}
mkdir -p "$(dirname "$JSON")"
step() { echo "[device_check] $(date -u +%T) $*"; }

SITE=${DEVICE_SITE:-${TMPDIR:-/tmp}/espo_device_site}
missing=()
for whl in .device_wheels/*.whl; do
  [[ -e "$whl" ]] || continue
  module=$(basename "$whl" | cut -d- -f1 | tr 'A-Z' 'a-z')
  "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$whl")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  step "installing ${#missing[@]} carried wheel(s) into $SITE: ${missing[*]##*/}"
  mkdir -p "$SITE"
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" \
      "${missing[@]}"
  else
    for whl in "${missing[@]}"; do "$PYTHON" -m zipfile -e "$whl" "$SITE"; done
  fi
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's espo_jax
export TF_CPP_MIN_LOG_LEVEL=3 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/espo_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-1}
if [[ ${#DRY[@]} -eq 0 ]] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
step "espo_jax device check -> $JSON"
BUDGET=${BUDGET_S:-$([[ ${#DRY[@]} -gt 0 ]] && echo 600 || echo 450)}
timeout $((BUDGET + 20)) "$PYTHON" -m espo_jax.bench device_check "${DRY[@]}" \
  --budget_s="$BUDGET" --out="$JSON"
step "done: $JSON"
