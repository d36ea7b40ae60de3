"""The benchmarks live outside the library: nothing installed imports them, ``dora-jax bench`` reaches them from a
source checkout whatever the current directory, and every result carries its command, device and date."""

import ast
import json
import subprocess
import sys
from pathlib import Path

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
    assert "--preset is for train only" in capsys.readouterr().err


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
    with pytest.raises(SystemExit):
        gpu.main(["--only", "engine,nonsense", "--out", str(tmp_path)])
