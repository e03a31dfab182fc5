#!/usr/bin/env bash
# Learner + N JAX rollout workers on one machine (train.loop=async). The learner process
# (python -m espo_jax.main) starts NUM_WORKERS rollout worker processes itself
# (espo_jax/train/async_loop.py); they meet only at WORKDIR/buffer (rollout groups) and
# WORKDIR/weights (the policy versions the learner publishes).
#
# Usage:  launch/async_local.sh [--config.x.y=value ...]
#   launch/async_local.sh                                         # arith_espo, laptop size
#   NUM_WORKERS=4 CONFIG=experiments/arith_espo.py WORKDIR=/tmp/espo_async launch/async_local.sh
#   TIMEOUT_S=900 launch/async_local.sh --config.train.steps=3    # CI: bounded wall time
# Env (defaults): CONFIG (experiments/arith_espo.py:small), WORKDIR (/tmp/espo_async),
#   NUM_WORKERS (2), PYTHON (python), TIMEOUT_S (0 = none; else stop the run after that many
#   seconds and exit 124), STOP_GRACE_S (180: time a stop may take before SIGKILL; the
#   learner itself gives its workers 120 s).
#
# Stopping: Ctrl-C or SIGTERM to this script sends SIGINT to the learner, which stops its
# workers (SIGTERM: each writes its complete groups and exits) and exits. The learner runs in
# its own process group (with its workers and reward pools); whatever of that group is still
# alive after the learner ends is killed and reported, so the script never leaves processes
# behind. Exit status: the learner's, 124 on TIMEOUT_S, 3 if processes had to be killed
# after a learner that exited 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
CONFIG=${CONFIG:-experiments/arith_espo.py:small}
WORKDIR=${WORKDIR:-/tmp/espo_async}
NUM_WORKERS=${NUM_WORKERS:-2}
TIMEOUT_S=${TIMEOUT_S:-0}
STOP_GRACE_S=${STOP_GRACE_S:-180}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-3}
unset ESPO_COORDINATOR ESPO_NUM_PROCESSES ESPO_PROCESS_ID ESPO_DISTRIBUTED
log() { echo "[async_local] $(date +%T) $*" >&2; }

group_alive() { kill -0 -- "-$LEARNER" 2>/dev/null; }

stop_learner() {  # SIGINT to the learner, then wait up to STOP_GRACE_S for it
  if kill -0 "$LEARNER" 2>/dev/null; then
    log "stopping the learner (SIGINT; up to ${STOP_GRACE_S}s)"
    kill -INT "$LEARNER" 2>/dev/null || true
    local i
    for ((i = 0; i < STOP_GRACE_S; i++)); do
      kill -0 "$LEARNER" 2>/dev/null || break
      sleep 1
    done
  fi
}

reap() {  # kill what is left of the learner's process group; returns 1 if anything was
  local i
  for ((i = 0; i < 10; i++)); do group_alive || return 0; sleep 1; done
  log "left over after the learner: $(pgrep -g "$LEARNER" -d ' ' -l 2>/dev/null || echo '?')"
  kill -TERM -- "-$LEARNER" 2>/dev/null || true
  for ((i = 0; i < 10; i++)); do group_alive || return 1; sleep 1; done
  kill -KILL -- "-$LEARNER" 2>/dev/null || true
  return 1
}

stop_watchdog() {  # the sleep inside it too (it would outlive its subshell)
  if [[ -n "${WATCHDOG:-}" ]]; then
    pkill -P "$WATCHDOG" 2>/dev/null || true
    kill "$WATCHDOG" 2>/dev/null || true
  fi
}

on_signal() {  # $1: exit status
  trap - INT TERM USR1
  stop_learner
  reap || true
  stop_watchdog
  exit "$1"
}

log "learner + $NUM_WORKERS rollout workers: $CONFIG -> $WORKDIR"
# setsid: the learner leads a new process group (pgid = its pid) that its workers join.
setsid "$PYTHON" -m espo_jax.main --config "$CONFIG" --workdir "$WORKDIR" \
  --config.train.loop=async --config.train.num_workers="$NUM_WORKERS" "$@" &
LEARNER=$!
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'log "timeout after ${TIMEOUT_S}s"; on_signal 124' USR1
WATCHDOG=
if ((TIMEOUT_S > 0)); then
  (sleep "$TIMEOUT_S" && kill -USR1 $$) &
  WATCHDOG=$!
fi

rc=0
wait "$LEARNER" || rc=$?
trap - INT TERM USR1
stop_watchdog
if ! reap; then
  log "killed processes that outlived the learner"
  if ((rc == 0)); then rc=3; fi
fi
if ((rc == 0)) && [[ -f "$WORKDIR/summary.json" ]]; then
  log "done: $WORKDIR/summary.json"
else
  log "learner exited with status $rc"
fi
exit "$rc"
