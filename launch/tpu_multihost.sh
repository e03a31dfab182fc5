#!/usr/bin/env bash
# A TPU slice (Cloud TPU VM, several hosts): copy this checkout to every host, install it,
# and run the same command on all of them with gcloud ... tpu-vm ssh --worker=all.
#
#   ROLE=learner (default)  the main job on every host of the slice as one JAX system:
#            ESPO_DISTRIBUTED=auto makes espo_jax.distributed call jax.distributed.initialize(),
#            which finds the other hosts through the TPU metadata; the mesh spans all chips
#            (experiments/qwen3_30b_a3b.py:tpu: fsdp over the 32 chips of a v5p-64). With
#            train.loop=async the learner starts no workers (train.num_workers=0): rollouts
#            come from vLLM workers on GPUs (launch/slurm_vllm.sbatch's rollout step, or
#            python -m espo_jax.rollout.vllm_cli by hand) or from ROLE=rollout on a second slice.
#   ROLE=rollout            JAX rollout workers on single-host TPU VMs (TPU_NAME: a
#            comma-separated list of them): python -m espo_jax.main --config.mode=rollout
#            --config.rollout.engine=jax (the config's vLLM engine is for GPUs), one
#            independent process per VM on its chips (no jax.distributed), worker index = its
#            position in the list (--worker_index / --num_workers).
# Learner and workers meet at WORKDIR (buffer/, weights/): a filesystem mounted at the same
# path on every host of both sides (Filestore NFS or a gcsfuse mount of a bucket).
#
# Usage:
#   TPU_NAME=espo-v5p-64 ZONE=us-east5-a WORKDIR=/mnt/shared/espo_q30b launch/tpu_multihost.sh
#   TPU_NAME=espo-v5p-64 WORKDIR=/mnt/shared/q30 launch/tpu_multihost.sh --config.train.steps=200
#   ROLE=rollout TPU_NAME=roll-0,roll-1 WORKDIR=/mnt/shared/q30 launch/tpu_multihost.sh
# Env (defaults): TPU_NAME (required; ROLE=rollout: a comma-separated list), ZONE (gcloud's default zone), PROJECT (gcloud's
#   default project), WORKDIR (required; shared mount), CONFIG
#   (experiments/qwen3_30b_a3b.py:tpu), ROLE (learner), REMOTE_DIR (espo_jax, under the
#   remote home), SETUP (1: copy and install first; 0: run only), PYTHON (python3 on the
#   hosts), INSTALL (the remote install command; default: pip install -e . plus jax[tpu] of
#   the same JAX version). Extra arguments go to the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
TPU_NAME=${TPU_NAME:?set TPU_NAME to the TPU VM (slice) name}
WORKDIR=${WORKDIR:?set WORKDIR to a path mounted on every host (NFS or gcsfuse)}
CONFIG=${CONFIG:-experiments/qwen3_30b_a3b.py:tpu}
ROLE=${ROLE:-learner}
REMOTE_DIR=${REMOTE_DIR:-espo_jax}
SETUP=${SETUP:-1}
PYTHON=${PYTHON:-python3}
JAX_VERSION=$(sed -n 's/.*"jax==\([0-9.]*\)".*/\1/p' setup.py | head -1)
INSTALL=${INSTALL:-"$PYTHON -m pip install -q -e . 'jax[tpu]==${JAX_VERSION:-0.10.2}'"}
GCLOUD=(gcloud compute tpus tpu-vm)
LOC=()
[[ -n "${ZONE:-}" ]] && LOC+=(--zone "$ZONE")
[[ -n "${PROJECT:-}" ]] && LOC+=(--project "$PROJECT")
log() { echo "[tpu_multihost] $(date +%T) $*" >&2; }
q() { printf '%q ' "$@"; }  # quote for the remote shell

case "$ROLE" in
  learner|rollout) ;;
  *) log "ROLE must be learner or rollout, got '$ROLE'"; exit 2 ;;
esac

IFS=, read -ra NAMES <<< "$TPU_NAME"
if [[ "$ROLE" == learner && ${#NAMES[@]} -ne 1 ]]; then
  log "ROLE=learner runs on one slice; TPU_NAME lists ${#NAMES[@]}"
  exit 2
fi
EXTRA=""
if (($#)); then EXTRA=$(q "$@"); fi

if [[ "$SETUP" == 1 ]]; then
  archive=$(mktemp -t espo_jax.XXXXXX.tar.gz)
  git archive --format=tar.gz -o "$archive" HEAD
  for name in "${NAMES[@]}"; do
    log "copying $(git rev-parse --short HEAD) to every host of $name:~/$REMOTE_DIR"
    "${GCLOUD[@]}" scp "${LOC[@]}" --worker=all "$archive" "$name:espo_jax.tar.gz"
    "${GCLOUD[@]}" ssh "${LOC[@]}" "$name" --worker=all --command \
      "set -e; mkdir -p $(q "$REMOTE_DIR"); tar xzf espo_jax.tar.gz -C $(q "$REMOTE_DIR"); \
       cd $(q "$REMOTE_DIR") && $INSTALL"
  done
  rm -f "$archive"
fi

ENV="export TF_CPP_MIN_LOG_LEVEL=3 HF_HUB_OFFLINE=1;"
MAIN="$PYTHON -m espo_jax.main --config $(q "$CONFIG") --workdir $(q "$WORKDIR")"
if [[ "$ROLE" == learner ]]; then
  log "learner on all hosts of $TPU_NAME: $CONFIG -> $WORKDIR"
  exec "${GCLOUD[@]}" ssh "${LOC[@]}" "$TPU_NAME" --worker=all --command \
    "$ENV export ESPO_DISTRIBUTED=auto; cd $(q "$REMOTE_DIR") && \
     $MAIN --config.train.loop=async --config.train.num_workers=0 $EXTRA"
fi

log "rollout workers on ${#NAMES[@]} TPU VMs (${NAMES[*]}) -> $WORKDIR"
pids=()
for i in "${!NAMES[@]}"; do
  "${GCLOUD[@]}" ssh "${LOC[@]}" "${NAMES[$i]}" --worker=all --command \
    "$ENV export ESPO_DISTRIBUTED=off; cd $(q "$REMOTE_DIR") && \
     $MAIN --config.mode=rollout --config.rollout.engine=jax --worker_index=$i \
     --num_workers=${#NAMES[@]} $EXTRA" &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' INT TERM
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit "$rc"
