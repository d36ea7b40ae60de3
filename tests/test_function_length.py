"""No function of the library is longer than :data:`LONGEST` lines: a longer one is split into named steps (as the
simulator's run and the train step are)."""

import ast
from pathlib import Path

LONGEST = 80
PACKAGE = Path(__file__).resolve().parent.parent / "dora_jax"


def long_functions(source: str, name: str) -> list[str]:
    """``file:line function (N lines)`` for each function or method of ``source`` over :data:`LONGEST` lines, its
    decorators and docstring included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = node.end_lineno - first + 1
            if lines > LONGEST:
                out.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_library_function_is_longer_than_the_limit():
    found = [x for path in sorted(PACKAGE.rglob("*.py"))
             for x in long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, f"functions over {LONGEST} lines: {found}"


def test_the_scan_catches_a_planted_long_function_and_a_long_method():
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST - 1))
    short = f"def f():\n{body}\n"  # the def line and LONGEST - 1 statements: at the limit
    assert long_functions(short, "m.py") == []
    assert long_functions(short + "    return x0\n", "m.py") == [f"m.py:1 f ({LONGEST + 1} lines)"]
    method = "class C:\n    @staticmethod\n    def g():\n" + "\n".join(f"        y{i} = {i}" for i in range(LONGEST))
    assert long_functions(method, "m.py") == [f"m.py:3 g ({LONGEST + 2} lines)"]
