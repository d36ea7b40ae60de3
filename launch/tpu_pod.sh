#!/usr/bin/env bash
# Runs a dora-jax command on every worker of a Cloud TPU VM slice (a pod slice is one program per host;
# jax.distributed.initialize() finds the other workers itself): creates the TPU VM unless it exists, copies
# this checkout, installs it, runs the command on --worker=all, and gathers each worker's log into
# runs/logs/TPU_NAME/.
#
#   TPU_NAME=dora-v5p ZONE=us-east5-a ACCELERATOR_TYPE=v5p-64 RUNTIME_VERSION=v2-alpha-tpuv5 \
#     launch/tpu_pod.sh train --config llama3_1_8b_v5p64
#   launch/tpu_pod.sh --dry-run train ...   (print the gcloud commands only)
# Optional: PROJECT (gcloud's default otherwise), SPOT=1 (a preemptible slice), SKIP_CREATE=1, DORA_PYTHON (the
# Python version of the workers' environment, default 3.11; dora-jax needs 3.11 or newer).
# Split placement: --trainer-devices-per-host T with TPU_HOSTS (the slice's worker count, 8 for a v5p-64):
# T chips of every worker train, the others decode.
# TPU VM images ship an older Python (3.10), so each worker builds its environment with uv, which uses a
# Python of that version when the VM has one and installs a standalone build of it otherwise.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=_lib.sh
source "$here/_lib.sh"

train_per_host=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --trainer-devices-per-host) need_value "$@"; train_per_host="$2"; shift 2 ;;
    --) shift; break ;;
    -*) echo "error: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--dry-run] [--trainer-devices-per-host T] DORA_JAX_ARGS...   (see the variables at the top of this file)" >&2
  exit 2
fi
need_vars TPU_NAME ZONE ACCELERATOR_TYPE RUNTIME_VERSION
if [[ -n "$train_per_host" ]]; then
  need_vars TPU_HOSTS
  need_int TPU_HOSTS
  overrides="$(split_overrides --trainer-devices-per-host "$train_per_host" "$TPU_HOSTS")"
  read -r -a split <<<"$overrides"
  set -- "$@" "${split[@]}"
fi
python="${DORA_PYTHON:-3.11}"
if ! [[ "$python" =~ ^3\.([0-9]+)(\.[0-9]+)?$ ]] || (( BASH_REMATCH[1] < 11 )); then
  echo "error: DORA_PYTHON must be a Python version 3.11 or newer (e.g. 3.12), got '$python'" >&2
  exit 2
fi
if [[ -z "$DRY_RUN" ]] && ! command -v gcloud >/dev/null; then
  echo "error: gcloud not found; install the Google Cloud SDK" >&2
  exit 2
fi

repo="$(dirname "$here")"
tpu=(gcloud compute tpus tpu-vm)
where=("--zone=$ZONE")
if [[ -n "${PROJECT:-}" ]]; then
  where+=("--project=$PROJECT")
fi
remote_dir="dora_jax"
archive="/tmp/dora_jax_${TPU_NAME}.tar.gz"
log_dir="runs/logs/$TPU_NAME"

if [[ -z "${SKIP_CREATE:-}" ]]; then
  if [[ -n "$DRY_RUN" ]] || ! "${tpu[@]}" describe "$TPU_NAME" "${where[@]}" >/dev/null 2>&1; then
    create=("${tpu[@]}" create "$TPU_NAME" "${where[@]}" "--accelerator-type=$ACCELERATOR_TYPE"
            "--version=$RUNTIME_VERSION")
    if [[ -n "${SPOT:-}" ]]; then
      create+=(--spot)
    fi
    [[ -n "$DRY_RUN" ]] && echo "# if '${tpu[*]} describe $TPU_NAME' finds no TPU VM:"
    run "${create[@]}"
  fi
fi

# This checkout's working tree, without the virtual environment, git objects and run outputs.
run tar -czf "$archive" -C "$repo" --exclude=.venv --exclude=.git --exclude=runs .
run "${tpu[@]}" scp "$archive" "$TPU_NAME:dora_jax.tar.gz" --worker=all "${where[@]}"

install="rm -rf $remote_dir && mkdir -p $remote_dir && tar -xzf dora_jax.tar.gz -C $remote_dir && cd $remote_dir"
# uv from PyPI with the VM's pip, or its standalone installer where pip refuses user installs; both put it in
# ~/.local/bin.
uv="\$HOME/.local/bin/uv"  # expanded on the worker
install+=" && { python3 -m pip install --user --quiet uv || curl -LsSf https://astral.sh/uv/install.sh | sh; }"
install+=" && $uv venv --seed --python $python .venv && $uv pip install --python .venv/bin/python --quiet -e '.[tpu]'"
run "${tpu[@]}" ssh "$TPU_NAME" --worker=all "${where[@]}" --command="$install"

args="$(printf '%q ' "$@")"
# exec: the run is the process a preemption's SIGTERM reaches (it checkpoints and exits 0).
train="cd $remote_dir && mkdir -p logs && exec .venv/bin/dora-jax $args> logs/\$(hostname).log 2>&1"
run "${tpu[@]}" ssh "$TPU_NAME" --worker=all "${where[@]}" --command="$train"

if [[ -z "$DRY_RUN" ]]; then mkdir -p "$log_dir"; fi
run "${tpu[@]}" scp "$TPU_NAME:$remote_dir/logs/*" "$log_dir/" --worker=all "${where[@]}"
