#!/usr/bin/env bash
# Downloads the wheels launch/device_check.sh installs on a GPU machine without network: the
# packages espo_jax's learner, engine, buffer, models and the checked tests import that a bare
# JAX + CUDA image (JAX, flax, optax, orbax-checkpoint, torch, transformers, numpy, safetensors,
# tokenizers, msgpack, etils, absl-py, pyarrow, and what they pull in: PyYAML, rich, pygments,
# packaging) lacks. Python 3.12, manylinux x86_64, no dependencies resolved (each is listed).
#
#   package          version   why                                      bytes (2026-12-05)
#   ml-collections   1.1.0     run configs (ConfigDict)                      76,707
#   array-record     0.8.6     the buffer's file format (cp312 wheel)     3,846,599
#   pytest           9.2.0     the device check's test subset               411,776
#   pluggy           1.7.0     pytest                                        27,082
#   iniconfig        2.3.1     pytest                                         7,552
#   total                                                                4,369,716 (4.2 MiB of
#                                                                        the 64 MiB a call carries)
#
# Usage:  launch/device_wheels.sh [DIR]     (default .device_wheels/, git-ignored; it travels
#                                            with the working tree to the device machine)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.device_wheels}
PYTHON=${PYTHON:-python}
WHEELS=(ml-collections==1.1.0 array-record==0.8.6 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1)
mkdir -p "$DIR"
"$PYTHON" -m pip download --quiet --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --no-deps --dest "$DIR" "${WHEELS[@]}"
n=$(ls "$DIR"/*.whl | wc -l)
if [[ "$n" -ne "${#WHEELS[@]}" ]]; then
  echo "[device_wheels] expected ${#WHEELS[@]} wheels in $DIR, found $n:" >&2
  ls "$DIR" >&2
  exit 1
fi
du -ab "$DIR"/*.whl | awk '{printf "%10d  %s\n", $1, $2; t += $1} END {printf "%10d  total (%.1f MiB)\n", t, t / 1048576}'
