#!/usr/bin/env bash
# One process on one machine (the default layout): the learner and the embedded JAX rollout
# engine alternate in one process (train.loop=sync); the mesh uses this machine's devices.
#
# Usage:  launch/local.sh [--config.x.y=value ...]
#   launch/local.sh                                               # arith_espo, laptop size
#   CONFIG=experiments/arith_espo.py WORKDIR=/tmp/espo_arith launch/local.sh
#   CONFIG=experiments/arith_grpo.py:small launch/local.sh --config.train.steps=4
# Env (defaults): CONFIG (experiments/arith_espo.py:small), WORKDIR (/tmp/espo_local),
#   PYTHON (python). Outputs in WORKDIR: metrics.jsonl, tensorboard/, checkpoints/,
#   summary.json; a second run with the same WORKDIR resumes from its last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
CONFIG=${CONFIG:-experiments/arith_espo.py:small}
WORKDIR=${WORKDIR:-/tmp/espo_local}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-3}
# One process: nothing inherited may turn on jax.distributed (espo_jax/distributed.py).
unset ESPO_COORDINATOR ESPO_NUM_PROCESSES ESPO_PROCESS_ID ESPO_DISTRIBUTED
echo "[local] $CONFIG -> $WORKDIR"
exec "$PYTHON" -m espo_jax.main --config "$CONFIG" --workdir "$WORKDIR" \
  --config.train.loop=sync "$@"
