#!/usr/bin/env bash
# Starts this node's share of a multi-node GPU run; run it once on every node (pdsh, a Kubernetes job, or by
# hand), with the same arguments everywhere and these environment variables:
#   DORA_COORDINATOR     host:port of node 0 (process 0 listens there)
#   DORA_NUM_NODES       number of nodes
#   DORA_NODE_RANK       this node's rank, 0 .. DORA_NUM_NODES-1
#   DORA_PROCS_PER_NODE  1 (default): one process sees every GPU of the node; or the GPU count: one process
#                        per GPU (CUDA_VISIBLE_DEVICES=i)
#
#   DORA_COORDINATOR=10.0.0.1:8476 DORA_NUM_NODES=2 DORA_NODE_RANK=0 \
#     launch/multinode_gpu.sh train --config qwen2_5_7b_8gpu
#   launch/multinode_gpu.sh --dry-run train ...   (print the commands only)
#   launch/multinode_gpu.sh --trainer-devices-per-host 4 train ...   (split placement: 4 GPUs of every node
#     train, the other GPUs of each node decode; one process per node)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=_lib.sh
source "$here/_lib.sh"

log_dir="runs/logs/multinode"
train_per_host=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --log-dir) need_value "$@"; log_dir="$2"; shift 2 ;;
    --trainer-devices-per-host) need_value "$@"; train_per_host="$2"; shift 2 ;;
    --) shift; break ;;
    -*) echo "error: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--dry-run] [--log-dir D] [--trainer-devices-per-host T] DORA_JAX_ARGS...   (see the variables at the top of this file)" >&2
  exit 2
fi
need_vars DORA_COORDINATOR DORA_NUM_NODES DORA_NODE_RANK
DORA_PROCS_PER_NODE="${DORA_PROCS_PER_NODE:-1}"
need_int DORA_NUM_NODES
need_int DORA_NODE_RANK 0
need_int DORA_PROCS_PER_NODE
if [[ "$DORA_NODE_RANK" -ge "$DORA_NUM_NODES" ]]; then
  echo "error: DORA_NODE_RANK=$DORA_NODE_RANK must be < DORA_NUM_NODES=$DORA_NUM_NODES" >&2
  exit 2
fi
if ! [[ "$DORA_COORDINATOR" =~ ^[A-Za-z0-9._-]+:[0-9]+$ ]]; then
  echo "error: DORA_COORDINATOR must be host:port, got '$DORA_COORDINATOR'" >&2
  exit 2
fi
if [[ -n "$train_per_host" ]]; then
  if [[ "$DORA_PROCS_PER_NODE" -ne 1 ]]; then
    echo "error: --trainer-devices-per-host needs one process per node (DORA_PROCS_PER_NODE=1): each process trains on some of its node's GPUs and decodes on the others" >&2
    exit 2
  fi
  overrides="$(split_overrides --trainer-devices-per-host "$train_per_host" "$DORA_NUM_NODES")"
  read -r -a split <<<"$overrides"
  set -- "$@" "${split[@]}"
fi

bin="$(dora_bin "$(dirname "$here")")"
if [[ -z "$DRY_RUN" ]]; then
  [[ -x "$bin" ]] || { echo "error: $bin not found; run 'make install' or set DORA_JAX_BIN" >&2; exit 2; }
  mkdir -p "$log_dir"
fi
total=$((DORA_NUM_NODES * DORA_PROCS_PER_NODE))
pids=()
for ((local_rank = 0; local_rank < DORA_PROCS_PER_NODE; local_rank++)); do
  id=$((DORA_NODE_RANK * DORA_PROCS_PER_NODE + local_rank))
  cmd=(env "DORA_COORDINATOR=$DORA_COORDINATOR" "DORA_NUM_PROCESSES=$total" "DORA_PROCESS_ID=$id")
  if [[ "$DORA_PROCS_PER_NODE" -gt 1 ]]; then
    cmd+=("CUDA_VISIBLE_DEVICES=$local_rank")
  fi
  cmd+=("$bin" "$@")
  if [[ -n "$DRY_RUN" ]]; then
    show "${cmd[@]}"
  else
    "${cmd[@]}" >"$log_dir/process_$id.log" 2>&1 &
    pids+=("$!")
  fi
done
forward_signals "${pids[@]}"
wait_all "$log_dir/process_*.log" "${pids[@]}"
