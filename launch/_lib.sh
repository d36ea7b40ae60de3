#!/usr/bin/env bash
# Shared by the launch scripts: --dry-run handling, printing or running a command, required variables.
# Sourced, not run. A script sets DRY_RUN=1 (from --dry-run) before calling these.

DRY_RUN="${DRY_RUN:-}"

# Prints a command the way a shell would read it back.
show() {
  printf '%q ' "$@"
  echo
}

# Runs a command, or prints it under --dry-run.
run() {
  if [[ -n "$DRY_RUN" ]]; then
    show "$@"
  else
    "$@"
  fi
}

# Stops with a message naming every listed variable that is unset or empty.
need_vars() {
  local missing=()
  local name
  for name in "$@"; do
    if [[ -z "${!name:-}" ]]; then
      missing+=("$name")
    fi
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "error: environment variable(s) not set: ${missing[*]}" >&2
    exit 2
  fi
}

# Stops unless an option ("$1") has a value after it ("$2"): call as `need_value "$@"` before `shift 2`.
need_value() {
  if [[ $# -lt 2 || "$2" == --* ]]; then
    echo "error: option $1 needs a value" >&2
    exit 2
  fi
}

# Stops unless the named variable holds a positive integer.
need_int() {
  local name="$1"
  if ! [[ "${!name:-}" =~ ^[0-9]+$ ]] || [[ "${!name}" -lt "${2:-1}" ]]; then
    echo "error: $name must be an integer >= ${2:-1}, got '${!name:-}'" >&2
    exit 2
  fi
}

# XLA_FLAGS for M fake CPU devices, keeping the other flags already set (an earlier device count is dropped:
# XLA would take the last one). With M > 1, the flag that keeps the devices' collectives in one order comes
# next (dora_jax/xla_flags.py says why; a setting of the caller's own, later, still wins).
fake_device_flags() {
  local out="--xla_force_host_platform_device_count=$1"
  local safe="--xla_cpu_enable_concurrency_optimized_scheduler=false"
  local flag
  local -a flags=()
  read -r -a flags <<<"${XLA_FLAGS:-}"
  if (( $1 > 1 )) && [[ " ${flags[*]} " != *" $safe "* ]]; then
    out+=" $safe"
  fi
  for flag in "${flags[@]}"; do
    if [[ "$flag" != --xla_force_host_platform_device_count=* ]]; then
      out+=" $flag"
    fi
  done
  echo "$out"
}

# Split placement over P processes, N devices of each training: the overrides to append to the dora-jax
# command line. Arguments: the option or variable that set N (named in errors), N, P, and, when known, the
# devices each process drives, which must leave some to decode. The trainer's mesh spans the N training devices
# of every process; each process decodes on its others (docs/scale.md, "Roles").
split_overrides() {
  local name="$1" per_process="$2" processes="$3" devices="${4:-}"
  if ! [[ "$per_process" =~ ^[0-9]+$ ]] || (( per_process < 1 )); then
    echo "error: $name must be an integer >= 1, got '$per_process'" >&2
    exit 2
  fi
  if [[ -n "$devices" ]] && (( per_process >= devices )); then
    echo "error: $name=$per_process leaves none of a process's $devices devices to decode" >&2
    exit 2
  fi
  echo "roles.placement=split roles.trainer_devices=$((per_process * processes))"
}

# The dora-jax executable of this checkout (or DORA_JAX_BIN).
dora_bin() {
  local repo="$1"
  echo "${DORA_JAX_BIN:-$repo/.venv/bin/dora-jax}"
}

# Forwards SIGTERM and SIGINT (a preemption notice, a Ctrl-C) to the process ids given: each then finishes its
# train step, writes a checkpoint and exits 0 (docs/runner.md, "Preemption"); wait_all keeps waiting for them.
# A shell runs a trap only once the foreground command returns, so the processes must run in the background.
forward_signals() {
  FORWARD_PIDS=("$@")
  trap 'kill -TERM "${FORWARD_PIDS[@]}" 2>/dev/null || true' TERM INT
}

# Waits for every process id given after the logs' place (a path or glob); returns the last failure's exit
# status and points at the logs when there was one. A wait cut short by a forwarded signal (status > 128 while the
# process still runs) waits again.
wait_all() {
  local logs=$1 status=0 pid rc
  shift
  for pid in "$@"; do
    while true; do
      rc=0
      wait "$pid" || rc=$?
      if (( rc > 128 )) && kill -0 "$pid" 2>/dev/null; then
        continue
      fi
      break
    done
    if [[ "$rc" -ne 0 ]]; then
      status=$rc
    fi
  done
  if [[ "$status" -ne 0 ]]; then
    echo "error: a process failed (exit $status); see $logs" >&2
  fi
  return "$status"
}
