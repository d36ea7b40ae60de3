"""``pip install .`` gives a working package: the wheel holds every module of the source tree and the presets.

The wheel is built from a copy of the files a build reads (a build inside the repository would write
``build/`` there, and a module deleted from the source would stay in ``build/lib`` and in the next wheel), and
installed into a new virtualenv. That environment sees the dependencies of the one running the tests through a
``.pth`` file holding its site-packages folder: a path line in a ``.pth`` file adds the folder without
processing the ``.pth`` files inside it, so an editable install of the repository there stays out, and the
test checks that every module it imports comes from the new environment.
"""

import json
import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent

# Run by the new environment's interpreter from an empty folder: imports every module of the installed
# package, loads presets by name, and prints one JSON object.
CHECK = r"""
import importlib, json, pkgutil, traceback

import dora_jax

names, errors = {"dora_jax"}, {}
for info in pkgutil.walk_packages(dora_jax.__path__, "dora_jax.",
                                  onerror=lambda name: errors.setdefault(name, traceback.format_exc())):
    names.add(info.name)
files = {}
for name in sorted(names):
    try:
        files[name] = importlib.import_module(name).__file__
    except BaseException:
        errors[name] = traceback.format_exc()

from dora_jax.config import configs_dir, load_config
from dora_jax.sim.config import load_sim_config

presets = {}
for name, load in (("smollm2_arith", lambda n: load_config(n).model.family),
                   ("tiny_llama", lambda n: load_config(n).model.family),
                   ("sim_dora_paper", lambda n: load_sim_config(n).name)):
    try:
        presets[name] = load(name)
    except Exception as e:
        presets[name] = f"{type(e).__name__}: {e}"
print(json.dumps({"files": files, "errors": errors, "presets": presets, "configs_dir": configs_dir()}))
"""


def package_folders(root: Path) -> dict[str, Path]:
    """The package names a build installs from folders of ``root`` that are not named like the package:
    ``dora_jax`` itself and every ``[tool.setuptools.package-dir]`` entry of its pyproject.toml."""
    with open(root / "pyproject.toml", "rb") as f:
        mapped = tomllib.load(f)["tool"]["setuptools"].get("package-dir", {})
    return {"dora_jax": root / "dora_jax", **{name: root / folder for name, folder in mapped.items()}}


def source_modules(root: Path) -> set[str]:
    """Every module and package of the source tree at ``root``, by its installed name, found without importing."""
    out: set[str] = set()

    def walk(name: str, folder: Path) -> None:
        out.add(name)
        for info in pkgutil.iter_modules([str(folder)]):
            if info.ispkg:
                walk(f"{name}.{info.name}", folder / info.name)
            else:
                out.add(f"{name}.{info.name}")

    for name, folder in package_folders(root).items():
        walk(name, folder)
    return out


def module_set_problems(source: set[str], installed: set[str]) -> list[str]:
    """What differs between the modules of the source tree and those an install holds, one line per kind."""
    problems = []
    if missing := sorted(source - installed):
        problems.append(f"missing from the install: {', '.join(missing)}")
    if extra := sorted(installed - source):
        problems.append(f"installed but not in the source: {', '.join(extra)}")
    return problems


def test_source_modules_cover_the_mapped_folders():
    mods = source_modules(REPO)
    assert {"dora_jax.config", "dora_jax.tasks", "dora_jax.kernels.paged_attention",
            "dora_jax.configs"} <= mods
    assert not any(m.startswith(("kernels", "configs")) for m in mods)


@pytest.mark.parametrize("dropped", ["dora_jax.tasks", "dora_jax.kernels", "dora_jax.configs",
                                     "dora_jax.sim.lengths"])
def test_module_check_reports_a_missing_subpackage(dropped):
    """An install that lacks a subpackage (or one module) fails the check, naming what is missing."""
    source = source_modules(REPO)
    installed = {m for m in source if m != dropped and not m.startswith(dropped + ".")}
    problems = module_set_problems(source, installed)
    assert len(problems) == 1 and problems[0].startswith("missing from the install: ") and dropped in problems[0]
    assert module_set_problems(source, installed | {"dora_jax.stale"}) == [
        problems[0], "installed but not in the source: dora_jax.stale"]
    assert module_set_problems(source, set(source)) == []


def test_a_checkout_on_the_path_without_an_install_imports_the_kernels(tmp_path):
    """A source tree handed to a machine and put on PYTHONPATH, never installed (no editable finder: ``-S`` skips
    the .pth files that hold it): ``dora_jax.kernels`` is the tree's ``kernels/``, as an install would map it."""
    tree = tmp_path / "tree"
    for folder in ("dora_jax", "kernels", "benchmarks"):
        shutil.copytree(REPO / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    deps = os.pathsep.join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONHOME"}, "PYTHONPATH": f"{tree}{os.pathsep}{deps}"}
    probe = ("import dora_jax, dora_jax.kernels.paged_attention as p; "
             "print(p.__file__); print(dora_jax.kernels.paged_attention is p)")
    out = _run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env).stdout.split()
    assert out == [str(tree / "kernels" / "paged_attention.py"), "True"]
    # The accelerator script's own check that the kernels import, run as on such a machine (its first act there).
    _run([sys.executable, "-S", "-m", "benchmarks.gpu", "--budget-s", "1", "--only", "kernel", "--out", "r"],
         cwd=tree, env=env)
    assert json.load(open(tree / "r" / "summary.json"))["parts"]["kernel"]["status"] == "skipped"
    (tree / "kernels" / "__init__.py").unlink()  # a tree without the folder's package: the import fails as before
    shutil.rmtree(tree / "kernels")
    proc = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "No module named 'dora_jax.kernels'" in proc.stderr


def _build_requirements_met() -> bool:
    """Whether this environment holds every ``[build-system] requires`` entry of pyproject.toml."""
    with open(REPO / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    for req in map(Requirement, requires):
        try:
            if not req.specifier.contains(version(req.name), prereleases=True):
                return False
        except PackageNotFoundError:
            return False
    return True


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_wheel_installs_a_working_package(tmp_path):
    # The files a build reads: the build configuration, the README it embeds, and the package folders.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in package_folders(REPO).values():
        rel = folder.relative_to(REPO)
        shutil.copytree(folder, src / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    # The environment's setuptools builds it when it meets pyproject.toml's build requirement (no network);
    # otherwise pip installs that requirement into an isolated build environment.
    isolation = ["--no-build-isolation"] if _build_requirements_met() else []
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", *isolation,
          "-w", str(wheels), str(src)], cwd=tmp_path)
    (wheel,) = wheels.glob("dora_jax-*.whl")

    env_dir = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    py = env_dir / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_test_dependencies.pth").write_text("".join(f"{p}\n" for p in deps))
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--quiet", str(wheel)])

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = json.loads(_run([str(py), "-c", CHECK], cwd=work, env=env).stdout.strip().splitlines()[-1])

    assert not out["errors"], "\n".join(f"{name}:\n{tb}" for name, tb in out["errors"].items())
    installed_pkg = site / "dora_jax"
    outside = {name: f for name, f in out["files"].items() if not Path(f).is_relative_to(installed_pkg)}
    assert not outside, f"modules imported from outside the new environment: {outside}"
    assert module_set_problems(source_modules(src), set(out["files"])) == []
    assert out["presets"] == {"smollm2_arith": "llama", "tiny_llama": "llama", "sim_dora_paper": "dora_paper"}
    assert Path(out["configs_dir"]) == installed_pkg / "configs"

    help_ = _run([str(env_dir / "bin" / "dora-jax"), "--help"], cwd=work, env=env)
    assert help_.stdout.startswith("usage: dora-jax")
