#!/usr/bin/env bash
# Thin wrapper with the flags users of the flag-file run.sh know (its --log-path and
# --log_path are --run-dir):
#   scripts/run.sh --master --num-nodes 3 --rank-weights 1,1,1 --run-dir /shared/exp1 [...]
#   scripts/run.sh --worker 2 --run-dir /shared/exp1
#   scripts/run.sh --node-rank 2 --run-dir /shared/exp1     (0 = master)
# Every other flag is passed through to `coordinator run` unchanged.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${COORDINATOR_BIN:-}"
if [ -z "$bin" ]; then
  if [ -x "$here/.venv/bin/coordinator" ]; then bin="$here/.venv/bin/coordinator"; else bin=coordinator; fi
fi
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --node-rank|--node_rank)
      if [ "$2" = 0 ]; then args+=(--master); else args+=(--worker "$2"); fi
      shift 2 ;;
    --node-rank=*|--node_rank=*)
      r="${1#*=}"; if [ "$r" = 0 ]; then args+=(--master); else args+=(--worker "$r"); fi
      shift ;;
    --log_path) args+=(--run-dir "$2"); shift 2 ;;
    --num_nodes) args+=(--num-nodes "$2"); shift 2 ;;
    --rank_weights) args+=(--rank-weights "$2"); shift 2 ;;
    --rl_phase) args+=(--rl-phase "$2"); shift 2 ;;
    --eval_interval) args+=(--eval-interval "$2"); shift 2 ;;
    --rollout_split) args+=(--rollout-split "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
exec "$bin" run "${args[@]}"
