"""The ``bench`` command: ``dora-jax bench WHAT [options] [key=value ...]``. Parses the arguments, runs one
benchmark, prints its result as JSON and writes it with ``--json``; every result carries the command line that
produced it, the device and the date."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

DEFAULT_CONFIG = "smollm2_135m"
WHAT = ("load", "engine", "prefill", "decode", "train", "snapshot", "modes", "profile", "convergence", "kernel",
        "kernel-sweep", "soak")
NO_OVERRIDES = ("kernel", "kernel-sweep")  # built from fixed workloads, not from a config
TWO_HOST_DEVICES = ("modes", "profile")  # trainer and rollout each on a device of their own


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def build_parser(prog: str = "dora-jax bench") -> argparse.ArgumentParser:
    """The ``bench`` command's arguments.

    Args:
      prog: the command's name in usage and error messages.

    Returns:
      The parser.
    """
    b = argparse.ArgumentParser(prog=prog, description="Benchmarks; each prints its result as JSON. "
                                "docs/performance.md has the current numbers and the commands behind them.")
    b.add_argument("what", choices=WHAT)
    b.add_argument("--config", default=DEFAULT_CONFIG, help="YAML file or shipped preset name (modes, profile: "
                   "default tiny_llama; convergence: default smollm2_arith)")
    b.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.attention_impl=pallas_gpu")
    b.add_argument("--json", help="also write the result to this JSON file")
    b.add_argument("--steps", type=_positive_int, help="modes: updates per run (default 8); convergence: updates "
                   "per run (default: the config's dora.steps)")
    b.add_argument("--plot", help="modes: write the reward, throughput and simulated-vs-measured plot to this PNG; "
                   "convergence: the reward and accuracy plot; soak: memory, arrays, compiles, files, threads, disk")
    b.add_argument("--repeats", type=_positive_int, help="load: repeats per side (default 2); kernel: timed calls "
                   "per point (default 2); kernel-sweep: timed calls per setting (default 50); engine: "
                   "alternated runs of the fixed batch, engine and transformers (default 3); modes: timed runs "
                   "per mode, alternated (default 3)")
    b.add_argument("--warm-rounds", type=_positive_int, default=4, help="modes: untimed rounds at most, until one "
                   "compiles nothing (default 4; a timed run's own compile time is taken out of its wall time)")
    b.add_argument("--profile", help="modes: simulate with this 'bench profile' JSON of this machine (default: "
                   "measure one first); engine --preset accel: trace steady decode dispatches of the largest batch "
                   "with jax.profiler into this folder and write its top device ops (top_ops.json there)")
    b.add_argument("--modes", help="modes: comma-separated modes to run (default all: sync, one_step_off, dora_k1, "
                   "dora_k2, dora_k3; sync and dora_k2 always among them)")
    b.add_argument("--no-simulate", action="store_true", help="modes: measure no cost profile and simulate nothing "
                   "(the profile's sweeps run to the longest output: minutes at --preset reasoning)")
    b.add_argument("--groups", type=_positive_int, help="modes: run every mode under split placement on N rollout "
                   "groups of one device each after the trainer's (N + 1 devices; on CPU asked of XLA unless "
                   "XLA_FLAGS sets a count), adding dora_k2_1vpg (dora K = 2 at roles.versions_per_group=1; N >= 3) and "
                   "dora_k2_1vpg_elastic (the same with roles.elastic_group); "
                   "no shared placement runs, nothing simulated")
    b.add_argument("--seeds", type=_positive_int, default=4, help="convergence: seeds per run name")
    b.add_argument("--runs", help="convergence: comma-separated run names to train (default: all: sync, "
                   "dora_k2_none, dora_k2_decoupled, dora_k3_decoupled)")
    b.add_argument("--decoupled-cap", type=float, help="convergence: train.decoupled_cap of the runs with decoupled "
                   "PPO (AReaL's weight cap; default 5, the main job's measured recipe; 0: none)")
    b.add_argument("--merge", help="convergence: comma-separated results of the same recipe and machine (other run "
                   "names in each) to write as one, the target computed over them all; trains nothing")
    b.add_argument("--eval-size", type=_positive_int, help="convergence: held-out questions (default: enough for "
                   "256 answers)")
    b.add_argument("--batch", type=_positive_int, help="engine, decode: concurrent sequences (default 32; "
                   "engine --preset accel: 64 and 256); train, "
                   "snapshot: rows per step (default 8); kernel: slots per call (default 8 and 32)")
    b.add_argument("--new-tokens", type=_positive_int, default=128, help="engine: new tokens per sequence")
    b.add_argument("--no-reference", action="store_true", help="engine: skip the transformers side")
    b.add_argument("--preset", choices=("cpu", "accel", "reasoning"), help="modes: 'reasoning' = budgets up to "
                   "4,096 tokens on a SmolLM2-135M-shaped model (random weights, bf16), 4 updates, 2 timed runs a "
                   "mode (for an accelerator). train: 'accel' = long sequences (remat, blockwise "
                   "attention, chunked log-probs, bf16 compute) on a Qwen2.5-1.5B-shaped model at 2k/8k/32k tokens "
                   "(tokens/s, MFU, compiled temporary bytes); on a CPU, the memory analysis of a tiny model at "
                   "1k-8k. engine: 'cpu' = SmolLM2-135M float32, the default workload with its summary on top; "
                   "'accel' = a Qwen2.5-1.5B-shaped model (random weights, bf16) at 64 and 256 sequences, "
                   "long-tailed outputs up to 4,096 tokens")
    b.add_argument("--attention-impl", choices=("auto", "xla", "pallas_gpu", "pallas_tpu", "pallas_tpu_ragged"),
                   help="engine --preset accel: the decode attention over the page pool (default: "
                   "rollout.attention_impl's default)")
    b.add_argument("--quick", action="store_true", help="engine --preset cpu: a small form that runs in minutes; "
                   "engine --preset accel: the accelerator's requests, slots and lengths on a two-layer model, a "
                   "replay of its schedule on a CPU (its counts are the accelerator run's)")
    b.add_argument("--updates", type=_positive_int, help="soak: the run's updates (default 300)")
    b.add_argument("--sample-every", type=_positive_int, help="soak: updates between samples (default 10)")
    b.add_argument("--preempt-at", type=_positive_int, help="soak: send SIGTERM after this update (default: drawn "
                   "from --seed in the run's middle third)")
    b.add_argument("--seed", type=int, default=0, help="soak: draws the preemption update")
    return b


def _unwritable(path: str | None, flag: str) -> str | None:
    """Why ``path`` cannot be written as an output file, or None when it can (or is not given)."""
    if not path:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory; name a file"
    if not os.path.isdir(parent):
        return f"{flag} {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"{flag} {path}: the directory {parent} is not writable"
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark ``args`` names.

    Args:
      args: parsed by :func:`build_parser`.

    Returns:
      The benchmark's result.
    """
    ov = tuple(args.overrides)
    if args.what == "load":
        from benchmarks import load

        return load.bench_load(args.config, repeats=args.repeats or 2, overrides=ov)
    if args.what == "prefill":
        from benchmarks import prefill

        return prefill.bench_prefill(args.config, repeats=max(args.repeats or 2, 3), overrides=ov)
    if args.what == "decode":
        from benchmarks import decode

        return decode.bench_decode(args.config, batch=args.batch or 32, overrides=ov)
    if args.what == "train":
        from benchmarks import train

        if args.preset == "accel":
            return train.bench_train_accel(repeats=args.repeats or 3)
        return train.bench_train(args.config, rows=args.batch or 8, overrides=ov)
    if args.what == "snapshot":
        from benchmarks import snapshot

        return snapshot.bench_snapshot(args.config, rows=args.batch or 8, overrides=ov)
    if args.what == "engine":
        from benchmarks import engine

        if args.preset == "accel":
            return engine.bench_engine_accel(quick=args.quick, attention_impl=args.attention_impl,
                                             batches=(args.batch,) if args.batch else None, profile=args.profile)
        if args.preset == "cpu":
            return engine.bench_engine_cpu(quick=args.quick, with_hf=not args.no_reference, rounds=args.repeats or 3)
        return engine.bench_engine(args.config, batch=args.batch or 32, new_tokens=args.new_tokens,
                                   with_hf=not args.no_reference, overrides=ov, rounds=args.repeats or 3)
    if args.what == "modes":
        from benchmarks import modes

        chosen = tuple(args.modes.split(",")) if args.modes else None
        if args.preset == "reasoning":
            r = modes.REASONING
            return modes.bench_modes(r["config"], steps=args.steps or r["steps"], repeats=args.repeats or r["repeats"],
                                     noise_seeds=r["noise_seeds"], profile=args.profile, max_len=r["max_len"],
                                     overrides=tuple(r["overrides"]), warm_rounds=args.warm_rounds,
                                     profile_grid=r["profile_grid"], modes=chosen,
                                     simulate=not args.no_simulate, groups=args.groups or 1)
        return modes.bench_modes("tiny_llama" if args.config == DEFAULT_CONFIG else args.config,
                                 steps=args.steps or 8, repeats=args.repeats or 3, profile=args.profile,
                                 overrides=ov, warm_rounds=args.warm_rounds, modes=chosen,
                                 simulate=not args.no_simulate, groups=args.groups or 1)
    if args.what == "profile":
        from benchmarks import profile

        return profile.bench_profile("tiny_llama" if args.config == DEFAULT_CONFIG else args.config, overrides=ov)
    if args.what == "convergence":
        from benchmarks import convergence

        if args.merge:
            return convergence.merge(args.merge.split(","))
        return convergence.bench_convergence(convergence.CONFIG if args.config == DEFAULT_CONFIG else args.config,
                                             seeds=args.seeds, steps=args.steps, eval_size=args.eval_size,
                                             overrides=ov, names=tuple(args.runs.split(",")) if args.runs else (),
                                             decoupled_cap=convergence.DECOUPLED_CAP if args.decoupled_cap is None
                                             else args.decoupled_cap)
    if args.what == "kernel":
        from benchmarks import kernel

        return kernel.bench_kernel(batches=(args.batch,) if args.batch else (8, 32), repeats=args.repeats or 2)
    if args.what == "kernel-sweep":
        from benchmarks import kernel

        return kernel.sweep_kernel_tiles(repeats=args.repeats or 50)
    if args.what == "soak":
        from benchmarks import soak

        return soak.bench_soak(args.updates or 300, every=args.sample_every or soak.SAMPLE_EVERY,
                               preempt_at=args.preempt_at, seed=args.seed, overrides=ov,
                               config=soak.CONFIG if args.config == DEFAULT_CONFIG else args.config)
    raise AssertionError(args.what)  # argparse restricts the choices


def _groups_problem(args: argparse.Namespace, prog: str) -> str | None:
    """Why ``--groups`` does not apply to these arguments, or None when it does (or is not given)."""
    if args.groups is None:
        return None
    if args.what != "modes":
        return f"{prog} {args.what}: --groups is for modes only"
    if args.profile:
        return f"{prog} modes --groups: simulates nothing (the simulator knows one pool of slots); drop --profile"
    return None


def main(argv: Sequence[str] | None = None, prog: str = "dora-jax bench") -> int:
    """Parses ``argv``, runs the benchmark and prints (and with ``--json`` writes) its stamped result.

    Output paths are checked before any work. ``key=value`` overrides may also follow options.

    Args:
      argv: the arguments after ``bench``; default ``sys.argv[1:]``.
      prog: the command as typed, recorded in the result's ``command``.

    Returns:
      The exit status: 0, or 2 for an output path that cannot be written or overrides the benchmark does not
      take (argparse exits with 2 itself on other bad arguments).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = list(args.overrides) + extra
    problems = [p for p in (_unwritable(args.json, "--json"), _unwritable(args.plot, "--plot")) if p]
    if args.overrides and args.what in NO_OVERRIDES:
        problems.append(f"{prog} {args.what}: takes no key=value overrides (got {' '.join(args.overrides)})")
    if args.preset and args.what not in ("train", "engine", "modes"):
        problems.append(f"{prog} {args.what}: --preset is for train (accel), engine (cpu, accel) and modes "
                        "(reasoning)")
    elif (args.preset == "reasoning") != (args.what == "modes" and args.preset is not None):
        problems.append(f"{prog} {args.what}: --preset {args.preset} is not one of its presets (train: accel; "
                        "engine: cpu, accel; modes: reasoning)")
    elif args.preset == "cpu" and args.what == "train":
        problems.append(f"{prog} train: --preset cpu is for engine only")
    if args.preset and (args.overrides or args.config != DEFAULT_CONFIG):
        problems.append(f"{prog} {args.what} --preset {args.preset}: builds its own model and settings; it takes no "
                        "--config or key=value overrides")
    if args.attention_impl and not (args.what == "engine" and args.preset == "accel"):
        problems.append(f"{prog} {args.what}: --attention-impl is for engine --preset accel only (elsewhere: "
                        "rollout.attention_impl=...)")
    if (args.modes or args.no_simulate) and args.what != "modes":
        problems.append(f"{prog} {args.what}: --modes and --no-simulate are for modes only")
    if args.profile and args.what not in ("modes", "engine") or args.what == "engine" and args.profile \
            and args.preset != "accel":
        problems.append(f"{prog} {args.what}: --profile is for modes and engine --preset accel only")
    elif args.no_simulate and args.profile:
        problems.append(f"{prog} modes: --profile is what it simulates with; --no-simulate simulates nothing")
    elif args.modes:
        from benchmarks.modes import plan

        try:
            plan(False, tuple(args.modes.split(",")))
        except ValueError as e:
            problems.append(f"{prog} modes --modes: {e}")
    problems += [p for p in (_groups_problem(args, prog),) if p]
    if args.merge and args.what != "convergence":
        problems.append(f"{prog} {args.what}: --merge is for convergence only")
    elif args.merge and (args.runs or args.overrides or args.steps or args.eval_size or args.decoupled_cap is not None
                         or args.seeds != parser.get_default("seeds") or args.config != DEFAULT_CONFIG):
        problems.append(f"{prog} convergence --merge: trains nothing; it takes no --runs, --seeds, --steps, "
                        "--eval-size, --decoupled-cap, --config or key=value overrides")
    if args.quick and not (args.what == "engine" and args.preset):
        problems.append(f"{prog} {args.what}: --quick is for engine --preset only")
    if (args.updates or args.sample_every or args.preempt_at or args.seed) and args.what != "soak":
        problems.append(f"{prog} {args.what}: --updates, --sample-every, --preempt-at and --seed are for soak only")
    elif args.preempt_at and args.preempt_at >= (args.updates or 300):
        problems.append(f"{prog} soak: --preempt-at {args.preempt_at} must come before the last update "
                        f"({args.updates or 300})")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    if args.what in TWO_HOST_DEVICES and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        from dora_jax.xla_flags import cpu_device_flags

        # Two host devices (before JAX starts its CPU backend): trainer and rollout each get one; with --groups,
        # the trainer and each rollout group one.
        os.environ["XLA_FLAGS"] = cpu_device_flags(1 + (args.groups or 1))

    from benchmarks.record import command_line, stamp, write_json

    try:
        produced = run(args)
    except ValueError as e:
        if not args.merge:
            raise
        print(f"error: {e}", file=sys.stderr)  # a merge's inputs are files: bad ones are named, not a traceback
        return 2
    result = stamp(produced, command_line(prog, argv))
    print(json.dumps(result, indent=1))
    if args.json:
        write_json(result, args.json)
    if args.plot and args.what in ("modes", "convergence", "soak"):
        from benchmarks import convergence, modes, soak

        draw = {"modes": modes.plot_modes, "convergence": convergence.plot_convergence,
                "soak": soak.plot_soak}[args.what]
        print("plot:", draw(result, args.plot))
    return 0
