"""``dora-jax`` command line: parses arguments and calls library functions; it decides nothing itself."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command imports the config module only when it runs one
    from dora_jax.config import Config

DEFAULT_CONFIG = "smollm2_135m"


def _load(args) -> "Config":
    from dora_jax.config import load_config

    overrides = list(args.overrides)
    if getattr(args, "weights", None):
        overrides.append(f"model.weights={args.weights}")
    return load_config(args.config, overrides)


def cmd_generate(args) -> int:
    from dora_jax.rollout.chat import chat, chat_engine, load_chat_model

    cfg = _load(args)
    if args.weights and args.from_weights:
        from dora_jax.config import Config
        from dora_jax.models.weights import model_config_from_weights

        cfg = Config(model=model_config_from_weights(args.weights), mesh=cfg.mesh, generate=cfg.generate,
                     rollout=cfg.rollout, run=cfg.run)
    prompts = args.prompt or list(cfg.generate.prompts)
    if not prompts:
        print("error: no prompts (pass --prompt or set generate.prompts)", file=sys.stderr)
        return 2
    model, tokenizer, load_s = load_chat_model(cfg)
    print(f"loaded {cfg.model.weights or 'random init'} in {load_s:.1f}s")
    engine = chat_engine(model, tokenizer, prompts, cfg)
    chat(model, tokenizer, prompts, cfg, engine)  # the first call compiles; the timed one below is steady-state
    results, t = chat(model, tokenizer, prompts, cfg, engine)
    for r in results:
        print(f"\n> {r.prompt}\n{r.answer}   [{r.new_tokens} tokens, {r.finish_reason}]")
    print(f"\nbatch of {len(prompts)}: {t['new_tokens']:.0f} new tokens in {t['wall_s']:.2f}s "
          f"(prefill included): {t['tokens_per_s']:.1f} tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_s": load_s, **t, "results": [r.__dict__ for r in results]}, f, indent=1)
    return 0


def cmd_demo(args) -> int:
    if args.config is not None:
        raise CLIError(f"demo --config {args.config}: the demo always runs the built-in default "
                       f"({DEFAULT_CONFIG}); for another config run 'dora-jax generate --config {args.config}'")
    print("dora-jax demo: SmolLM2-135M-Instruct on the CPU answers arithmetic questions\n")
    args.config, args.weights, args.from_weights, args.prompt = DEFAULT_CONFIG, None, False, None
    return cmd_generate(args)


def cmd_train(args) -> int:
    import os

    from dora_jax.run import Runner
    from dora_jax.run.setup import no_empty_run_dir

    cfg = _load(args)
    run_dir = args.run_dir or os.path.join(cfg.run.out_dir, cfg.run.name)
    print(f"dora-jax train: {cfg.dora.mode} (K={cfg.train.max_staleness}, RBS={cfg.dora.rollout_batch}, "
          f"TBS={cfg.dora.train_batch}, G={cfg.train.group_size}), {cfg.dora.steps} updates on {cfg.task.name}; "
          f"writing {run_dir}")
    with no_empty_run_dir(run_dir):
        summary = Runner(cfg, run_dir).run()
    if summary.get("preempted"):
        print(f"dora-jax train: stopped on {summary['signal']} at update {summary['step']} of {cfg.dora.steps}; "
              f"checkpoint {summary['checkpoint']} written in {summary['checkpoint_s']:.1f} s. Run the same command "
              "to continue.")
        return 0
    print(json.dumps({k: v for k, v in summary.items() if k != "filtered_reasons"}, indent=1))
    print(f"accuracy on {summary['eval_n']} held-out answers: {summary['accuracy_before']:.3f} before, "
          f"{summary['accuracy_after']:.3f} after {summary['steps']} policy versions "
          f"(the run: {summary['wall_s']:.0f} s, {summary['train_s']:.0f} s of it in train steps)")
    import jax

    if not args.no_plot and jax.process_index() == 0:  # process 0 writes the run directory
        from dora_jax.metrics import plot_run

        print("plots:", ", ".join(plot_run(run_dir)))
    return 0


def cmd_eval(args) -> int:
    from dora_jax.run.heldout import evaluate_checkpoint, evaluate_weights

    if args.checkpoint:
        if args.config or args.weights:
            raise CLIError(f"eval --checkpoint {args.checkpoint}: the run's own config.json and checkpoint give the "
                           "model and its weights; drop --config/--weights (overrides such as task.eval_samples=4 "
                           "still apply)")
        result = evaluate_checkpoint(args.checkpoint, args.overrides)
    else:
        args.config = args.config or "smollm2_arith"
        result = evaluate_weights(_load(args))
    print(json.dumps(result, indent=1))
    k = result["k"]
    print(f"{result['task']}: accuracy {result['accuracy']:.3f} over {result['n']} answers; pass@{k} "
          f"{result['pass_at_k']:.3f} over {result['n'] // max(k, 1)} held-out questions")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def cmd_plot(args) -> int:
    from dora_jax.metrics import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def cmd_export(args) -> int:
    from dora_jax.models.weights import export_hf, load_model
    from dora_jax.sharding import create_mesh

    cfg = _load(args)
    t0 = time.perf_counter()
    model, tokenizer = load_model(cfg.model, create_mesh(cfg.mesh), cfg.mesh.logical_axis_rules)
    out = export_hf(model, args.out, tokenizer=tokenizer, dtype=args.dtype, overwrite=args.overwrite)
    print(f"exported to {out} in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_check(args) -> int:
    from dora_jax.check import check_in_subprocess

    return check_in_subprocess(args.config, args.overrides, do_compile=not args.no_compile, processes=args.processes)


def _benchmarks_main():
    """``benchmarks.cli.main`` from the repository's ``benchmarks/`` folder beside this package's source.

    The benchmarks are not part of the installed package: an editable install from a clone finds them beside
    ``dora_jax/`` (whatever the current directory), a wheel has none.
    """
    import importlib

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(repo, "benchmarks", "cli.py")):
        raise CLIError("dora-jax bench: the benchmarks are not installed with the package; they run from a source "
                       "checkout (git clone the repository, then pip install -e . in it)")
    if repo not in sys.path:
        sys.path.insert(0, repo)
    return importlib.import_module("benchmarks.cli").main


def cmd_bench(args) -> int:
    return _benchmarks_main()(args.bench_args)


def cmd_simulate(args) -> int:
    from dora_jax.sim.config import SimConfigError, load_sim_config
    from dora_jax.sim.report import format_report, plot, run_config

    try:
        cfg = load_sim_config(args.config)
        if args.profile:  # measured costs of a machine in place of the analytic ones
            from dora_jax.sim.profile import load_profile, with_profile

            cfg = with_profile(cfg, load_profile(args.profile))
    except SimConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = run_config(cfg)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        for path in plot(result, args.plot):
            print(f"wrote {path}")
    return 0


def _check_out_file(path: str | None, flag: str) -> None:
    """Refuses an output file that cannot be written before any work is done (not after it)."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path}: is a directory; name a file")
    if not os.path.isdir(parent):
        raise CLIError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise CLIError(f"{flag} {path}: the directory {parent} is not writable")


def _check_out_dir(path: str | None, flag: str) -> None:
    """Refuses an output directory that cannot be made or written, before any work is done."""
    if path is None:
        return
    if not path:
        raise CLIError(f"{flag}: empty path")
    nearest = os.path.abspath(path)
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        raise CLIError(f"{flag} {path}: {nearest} is a file, not a directory")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {path}: {nearest} is not writable")


class CLIError(ValueError):
    """An argument that cannot work, found before anything runs."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dora-jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, config_default=DEFAULT_CONFIG):
        sp.add_argument("--config", default=config_default, help="YAML file or shipped preset name" if config_default
                        else argparse.SUPPRESS)
        sp.add_argument("overrides", nargs="*", help="key=value overrides, e.g. generate.max_new_tokens=32")
        sp.add_argument("--json", help="also write results to this JSON file")

    g = sub.add_parser("generate", help="answer prompts with a model (chat template applied)")
    common(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: generate.prompts")
    g.add_argument("--weights", help="'smollm2', a .gguf file, a Hugging Face directory or a Hub model ORG/NAME "
                   "(through the Hugging Face cache; HF_HUB_OFFLINE=1 uses the cache alone)")
    g.add_argument("--from-weights", action="store_true",
                   help="take the architecture from the weights instead of the config")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="the built-in default: SmolLM2-135M-Instruct answers arithmetic on the CPU")
    common(d, config_default=None)
    d.set_defaults(fn=cmd_demo)

    t = sub.add_parser("train", help="RL post-training (sync, one_step_off or dora) with evaluation before and after")
    common(t, config_default="smollm2_arith")
    t.add_argument("--run-dir", help="default: run.out_dir/run.name")
    t.add_argument("--no-plot", action="store_true", help="skip the PNGs at the end")
    t.set_defaults(fn=cmd_train)

    ev = sub.add_parser("eval", help="held-out accuracy (pass@k, k = task.eval_samples) of weights on a task, or of a "
                        "run's newest checkpoint")
    ev.add_argument("--config", help="YAML file or shipped preset name (default: smollm2_arith)")
    ev.add_argument("overrides", nargs="*", help="key=value overrides, e.g. task.eval_size=200 task.eval_samples=4 "
                    "task.eval_temperature=1")
    ev.add_argument("--json", help="also write the result to this JSON file")
    ev.add_argument("--weights", help="'smollm2', a .gguf file or a Hugging Face directory (default: the config's "
                    "model.weights)")
    ev.add_argument("--checkpoint", metavar="RUN_DIR", help="evaluate the newest checkpoint of a training run, with "
                    "the run's config.json")
    ev.set_defaults(fn=cmd_eval)

    pl = sub.add_parser("plot", help="reward, staleness and version-timeline PNGs of a run directory")
    pl.add_argument("run_dir")
    pl.add_argument("--out", help="default: the run directory")
    pl.set_defaults(fn=cmd_plot)

    e = sub.add_parser("export", help="write the config's model as a Hugging Face directory")
    common(e)
    e.add_argument("--out", required=True)
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--overwrite", action="store_true")
    e.set_defaults(fn=cmd_export)
    c = sub.add_parser("check", help="does the config fit target.num_devices x target.memory_gib? compiles the train "
                       "and decode steps ahead of time on fake devices and reports memory per device")
    c.add_argument("--config", required=True, help="YAML file or shipped preset name")
    c.add_argument("overrides", nargs="*", help="key=value overrides, e.g. target.num_devices=16")
    c.add_argument("--no-compile", action="store_true", help="lower only: shardings and shapes, no activation sizes")
    c.add_argument("--processes", type=int, default=1, metavar="N",
                   help="lay the roles out as a run of N processes (hosts) does, each with target.num_devices / N")
    c.set_defaults(fn=cmd_check)

    # The benchmarks parse their own arguments (benchmarks/cli.py, in a source checkout): everything after
    # "bench" goes to them.
    b = sub.add_parser("bench", help="benchmarks, from a source checkout; results as JSON (dora-jax bench --help)",
                       add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    b.set_defaults(fn=cmd_bench)
    s = sub.add_parser("simulate", help="discrete-event cluster simulator of the rollout/trainer pipeline")
    s.add_argument("--config", default="sim_dora_paper", help="configs/sim_*.yaml file or preset name")
    s.add_argument("--json", help="also write every run's metrics to this JSON file")
    s.add_argument("--plot", help="write throughput and timeline PNGs into this directory")
    s.add_argument("--profile", help="a 'dora-jax bench profile' JSON: its measured costs replace the config's "
                   "(decode and train interpolated on its grids)")
    s.set_defaults(fn=cmd_simulate)
    return p


def main(argv: list[str] | None = None) -> int:
    from dora_jax.config import ConfigError
    from dora_jax.xla_flags import cpu_device_flags, fake_device_count

    try:
        if fake_device_count() > 1:  # before JAX starts its CPU backend (dora_jax.xla_flags says why)
            os.environ["XLA_FLAGS"] = cpu_device_flags()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # Overrides may come after options too (``train --run-dir D a=1 --no-plot b=2``): argparse takes one run
    # of positionals, so the later ones come back unrecognized and join the overrides here.
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":  # every argument after "bench" is the benchmarks' own, options included
        args.bench_args, extra = argv[argv.index("bench") + 1:], []
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        _check_out_file(getattr(args, "json", None), "--json")
        _check_out_dir(getattr(args, "plot", None) if args.command == "simulate" else None, "--plot")
        _check_out_dir(getattr(args, "out", None), "--out")  # plot, export
        if args.command == "train":
            from dora_jax.distributed import initialize

            initialize()  # joins the other hosts under jax.distributed; a no-op for one process
        return args.fn(args)
    except Exception as e:
        if not (isinstance(e, (CLIError, ConfigError)) or _input_error(e)):
            raise
        print(f"error: {e}", file=sys.stderr)  # bad input or saved state: the message names it
        return 2


# The errors that mean bad input or saved state, by the module that defines each. A command that never imported a
# module cannot have raised its error, so telling them apart imports nothing: `dora-jax check` starts its child
# process without having imported JAX itself.
_INPUT_ERRORS = (("dora_jax.distributed", "DistributedError"), ("dora_jax.models.hf_io", "WeightsError"),
                 ("dora_jax.tokenizer", "TokenizerError"), ("dora_jax.run.evaluation", "RunError"),
                 ("dora_jax.dora.scheduler", "ScheduleError"), ("dora_jax.tasks.data", "TaskDataError"),
                 ("dora_jax.run.resume", "ResumeError"), ("dora_jax.run.checkpoint", "CheckpointError"),
                 ("dora_jax.run.versions", "VersionError"), ("dora_jax.metrics", "MetricsError"),
                 ("dora_jax.trainer.batch", "BatchError"))


def _input_error(e: BaseException) -> bool:
    return any(isinstance(e, getattr(sys.modules[module], name)) for module, name in _INPUT_ERRORS
               if module in sys.modules)


if __name__ == "__main__":
    sys.exit(main())
