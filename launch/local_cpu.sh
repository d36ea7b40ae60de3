#!/usr/bin/env bash
# Runs a dora-jax command as N processes on this host, each with M fake CPU devices, joined by
# jax.distributed (gloo collectives): the multi-host code path without a cluster. With one process it is a
# single program on M fake devices, to try a sharded config without accelerators.
#
#   launch/local_cpu.sh --devices 8 export --config tiny_llama --out /tmp/tiny_hf
#   launch/local_cpu.sh --processes 2 --devices 4 train --config tiny_llama
#   launch/local_cpu.sh --dry-run --processes 2 --devices 4 train ...   (print the commands only)
#   launch/local_cpu.sh --processes 2 --devices 2 --trainer-devices-per-host 1 train --config tiny_llama
#
# Options: --processes N (1), --devices M per process (1), --port P coordinator port (8476),
# --log-dir D where processes 1..N-1 write their output (runs/logs/local_cpu); process 0 writes to the terminal;
# --trainer-devices-per-host T: split placement, T devices of each process train and the others decode.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=_lib.sh
source "$here/_lib.sh"

processes=1
devices=1
port=8476
log_dir="runs/logs/local_cpu"
train_per_host=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --processes) need_value "$@"; processes="$2"; shift 2 ;;
    --devices) need_value "$@"; devices="$2"; shift 2 ;;
    --port) need_value "$@"; port="$2"; shift 2 ;;
    --log-dir) need_value "$@"; log_dir="$2"; shift 2 ;;
    --trainer-devices-per-host) need_value "$@"; train_per_host="$2"; shift 2 ;;
    --) shift; break ;;
    -*) echo "error: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--dry-run] [--processes N] [--devices M] [--port P] [--trainer-devices-per-host T] DORA_JAX_ARGS..." >&2
  exit 2
fi
need_int processes
need_int devices
need_int port
if [[ -n "$train_per_host" ]]; then
  overrides="$(split_overrides --trainer-devices-per-host "$train_per_host" "$processes" "$devices")"
  read -r -a split <<<"$overrides"
  set -- "$@" "${split[@]}"
fi

bin="$(dora_bin "$(dirname "$here")")"
if [[ -z "$DRY_RUN" && ! -x "$bin" ]]; then
  echo "error: $bin not found; run 'make install' first or set DORA_JAX_BIN" >&2
  exit 2
fi
base=(env JAX_PLATFORMS=cpu "XLA_FLAGS=$(fake_device_flags "$devices")")

if [[ "$processes" -eq 1 ]]; then
  if [[ -n "$DRY_RUN" ]]; then show "${base[@]}" "$bin" "$@"; exit 0; fi
  exec "${base[@]}" "$bin" "$@"
fi

if [[ -z "$DRY_RUN" ]]; then mkdir -p "$log_dir"; fi
pids=()
for ((i = processes - 1; i >= 0; i--)); do
  cmd=("${base[@]}" "DORA_COORDINATOR=127.0.0.1:$port" "DORA_NUM_PROCESSES=$processes" "DORA_PROCESS_ID=$i"
       "$bin" "$@")
  if [[ -n "$DRY_RUN" ]]; then
    show "${cmd[@]}"
  elif [[ "$i" -eq 0 ]]; then
    "${cmd[@]}" &
    pids+=("$!")
  else
    "${cmd[@]}" >"$log_dir/process_$i.log" 2>&1 &
    pids+=("$!")
  fi
done
forward_signals "${pids[@]}"
wait_all "$log_dir/process_*.log" "${pids[@]}"
