"""Programming problems checked by running the model's program against reference tests in a sandbox.

Rows (:mod:`dora_jax.tasks.data`): a prompt and Python tests (HumanEval's ``test`` with ``entry_point``, MBPP's
``test_list`` with ``test_imports`` / ``test_setup_code``, or ``test_*`` functions), run after the program
(:func:`extract_program`). Reward 1.0 when program and tests run to their end in :mod:`dora_jax.sandbox`, else
0.0 with the reason. Fields and settings: docs/sandbox.md.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from dora_jax.sandbox import Limits, SandboxError, probe, run_python
from dora_jax.tasks.base import Item, Score, Task
from dora_jax.tasks.data import TaskDataError, pick, read_rows, row_prompt
from dora_jax.tasks.gsm8k import split_items

__all__ = ["CodeTask", "extract_program", "tests_script"]

log = logging.getLogger(__name__)

PROMPT_FIELDS = ("prompt", "question", "problem", "text")
TESTS_FIELDS = ("test", "tests", "test_list")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)
_PYTHON = ("python", "py", "python3")
_CALL_TESTS = """
for _name, _test in list(globals().items()):
    if _name.startswith("test_") and callable(_test):
        _test()
"""


def extract_program(response: str) -> str:
    """The program in a response: its last ```python block, else its last untagged block, else all of it."""
    blocks = _FENCE.findall(response)
    for langs in (_PYTHON, ("",)):
        tagged = [code for lang, code in blocks if lang.lower() in langs]
        if tagged:
            return tagged[-1]
    return response


def _source(value: object) -> str | None:
    """Python source given as a string or a list of lines (MBPP's ``test_list``, ``test_imports``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return None


def tests_script(where: str, row: dict, tests_field: str = "") -> str:
    """The tests of one row as one script to run after the program (``where`` names the row in errors)."""
    name, value = pick(row, tests_field, TESTS_FIELDS)
    tests = _source(value)
    if tests is None or not tests.strip():
        what = "missing" if value is None else repr(value)[:60]
        raise TaskDataError(f"{where}: needs tests in field {name!r} (Python source, or a list of assert lines); "
                            f"found {what} (set task.answer_field to the right field)")
    parts = [s for s in (_source(row.get("test_imports")), _source(row.get("test_setup_code"))) if s]
    parts.append(tests)
    entry = row.get("entry_point")
    if isinstance(entry, str) and entry.isidentifier() and re.search(r"^def check\(", tests, re.M):
        parts.append(f"check({entry})")
    if re.search(r"^def test_\w*\(", tests, re.M):
        parts.append(_CALL_TESTS)
    script = "\n\n".join(parts) + "\n"
    try:
        compile(script, where, "exec")
    except SyntaxError as e:
        raise TaskDataError(f"{where}: the tests in field {name!r} are not valid Python ({e.msg}, line {e.lineno} "
                            "of the tests)") from None
    return script


class CodeTask(Task):
    """Rows of ``path``, scored in the sandbox with ``limits`` and interpreter ``python`` (empty:
    :func:`dora_jax.sandbox.probe`'s choice). Construction probes the sandbox once and logs its protections."""

    name = "code"

    def __init__(self, path: str, eval_size: int = 64, seed: int = 0, *, prompt_field: str = "",
                 tests_field: str = "", split: str = "train", subset: str = "", limits: Limits = Limits(),
                 python: str = ""):
        items = [Item(row_prompt(where, row, prompt_field, PROMPT_FIELDS), tests_script(where, row, tests_field))
                 for where, row in read_rows(path, split=split, subset=subset)]
        self._train, self._eval = split_items(items, path, eval_size, seed)
        self.limits = limits
        try:
            self.protections, self.python = probe(python)
        except SandboxError as e:
            raise SandboxError(f"task.code_python = {python!r}: {e}") from None
        missing = [f.name for f in dataclasses.fields(self.protections) if not getattr(self.protections, f.name)]
        log.info("code task: programs run with %s, sandbox protections: %s", self.python, self.protections)
        if missing:
            log.warning("code task: the sandbox runs programs without %s on this machine (docs/sandbox.md says what "
                        "each needs)", ", ".join(missing))

    def train_item(self, index: int) -> Item:
        return self._train[index % len(self._train)]

    def eval_items(self) -> list[Item]:
        return list(self._eval)

    def score(self, item: Item, response: str) -> Score:
        result = run_python(extract_program(response) + "\n\n" + item.answer, self.limits, python=self.python,
                            protections=self.protections)
        return Score(1.0 if result.passed else 0.0, result.passed, result.reason)
