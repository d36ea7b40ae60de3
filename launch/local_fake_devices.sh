#!/usr/bin/env bash
# Runs any dora-jax command on N fake CPU devices of this host, to try a sharded config without accelerators.
#   launch/local_fake_devices.sh 8 export --config tiny_llama --out /tmp/tiny_hf
#   DRY_RUN=1 launch/local_fake_devices.sh 8 export ...   (print the command instead of running it)
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 NUM_DEVICES DORA_JAX_ARGS..." >&2
  exit 2
fi
num_devices="$1"
shift
if ! [[ "$num_devices" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NUM_DEVICES must be a positive integer, got '$num_devices'" >&2
  exit 2
fi

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${DORA_JAX_BIN:-$repo/.venv/bin/dora-jax}"
if [[ ! -x "$bin" ]]; then
  echo "error: $bin not found; run 'make install' first or set DORA_JAX_BIN" >&2
  exit 2
fi

cmd=(env JAX_PLATFORMS=cpu "XLA_FLAGS=--xla_force_host_platform_device_count=$num_devices ${XLA_FLAGS:-}" "$bin" "$@")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
else
  exec "${cmd[@]}"
fi
