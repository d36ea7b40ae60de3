"""Question/answer data for the data-driven tasks (``gsm8k``, ``math``, ``code``): :func:`load_rows` reads
``task.path`` (a ``.jsonl`` or ``.json`` file, read here; a ``.parquet`` file, a directory of data files or a
``datasets`` name, through ``datasets.load_dataset`` with ``task.split`` and ``task.subset``) and picks each
row's prompt and answer: ``task.prompt_field`` / ``task.answer_field`` (dotted paths reach nested objects;
empty: the task's usual names, in order). A prompt is a string or a chat (its last user message). A row without
both raises :class:`TaskDataError` naming the file (or data set) and row.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Sequence

from dora_jax.textfiles import TextFileError, read_jsonl, read_text


class TaskDataError(ValueError):
    """A data file or data set that cannot be used, with the file and row named."""


def read_rows(path: str, *, split: str = "train", subset: str = "") -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of ``path``; ``where`` names the file and line (or data set and row)."""
    if not path:
        raise TaskDataError("task.path: this task needs data: a .jsonl, .json or .parquet file, or a datasets name "
                            "(task.path=/path/to/train.jsonl)")
    lower = path.lower()
    if os.path.isfile(path) and lower.endswith(".jsonl"):
        try:
            rows = read_jsonl(path)
        except TextFileError as e:
            raise TaskDataError(str(e)) from None
        for n, row in rows:
            yield f"{path}:{n}", row
        return
    if os.path.isfile(path) and lower.endswith(".json"):
        try:
            data = json.loads(read_text(path))
        except TextFileError as e:
            raise TaskDataError(str(e)) from None
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, list):
            raise TaskDataError(f"{path}: expected a JSON list of objects (one per row), got {type(data).__name__}")
        for i, row in enumerate(data):
            yield f"{path}: row {i}", row
        return
    if os.path.isfile(path) and not lower.endswith(".parquet"):
        raise TaskDataError(f"task.path: {path!r} is a file of a kind dora-jax does not read; use .jsonl, .json or "
                            ".parquet")
    if not os.path.exists(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1
                                     or lower.endswith((".jsonl", ".json", ".parquet", ".csv"))):
        raise TaskDataError(f"task.path: {path!r} does not exist (and is not a datasets name such as "
                            "'openai/gsm8k')")
    ds = _load_dataset(path, split, subset)
    label = path if os.path.exists(path) else f"datasets {path!r} (split {split!r})"
    for i, row in enumerate(ds):
        yield f"{label}: row {i}", row


def _load_dataset(path: str, split: str, subset: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise TaskDataError(f"task.path: reading {path!r} needs the datasets library: pip install "
                            "'dora-jax[data]' (or use a .jsonl or .json file)") from None
    datasets.disable_progress_bars()
    try:
        if os.path.isfile(path):
            return datasets.load_dataset("parquet", data_files=path, split="train")
        return datasets.load_dataset(path, name=subset or None, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message says which and where
        raise TaskDataError(f"task.path: datasets could not load {path!r} (split {split!r}"
                            f"{f', subset {subset!r}' if subset else ''}): {type(e).__name__}: {e}") from None


def get_field(row: dict[str, Any], dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; None when any step is missing."""
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def pick(row: dict[str, Any], configured: str, defaults: Sequence[str]) -> tuple[str, Any]:
    """The field ``configured`` names, or the first of ``defaults`` the row has: ``(name, value)``."""
    for name in [configured] if configured else defaults:
        value = get_field(row, name)
        if value is not None:
            return name, value
    return (configured or " / ".join(defaults)), None


def prompt_text(value: Any) -> str | None:
    """A prompt given as a string, or as a chat whose last user message is the prompt."""
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if users and isinstance(users[-1], str) and users[-1].strip():
            return users[-1].strip()
    return None


def row_prompt(where: str, row: Any, prompt_field: str, defaults: Sequence[str]) -> str:
    """The prompt of one row (``where`` names it in the error when there is none)."""
    if not isinstance(row, dict):
        raise TaskDataError(f"{where}: expected an object with the question and answer, got {type(row).__name__}")
    pname, pvalue = pick(row, prompt_field, defaults)
    prompt = prompt_text(pvalue)
    if prompt is None:
        what = "missing" if pvalue is None else f"{type(pvalue).__name__} {str(pvalue)[:40]!r}"
        raise TaskDataError(f"{where}: needs a non-empty prompt in field {pname!r} (a string, or a chat with a "
                            f"user message); found {what} (set task.prompt_field to the right field)")
    return prompt


def load_rows(path: str, *, prompt_field: str, answer_field: str, prompt_defaults: Sequence[str],
              answer_defaults: Sequence[str], split: str = "train",
              subset: str = "") -> list[tuple[str, str, Any]]:
    """``(where, prompt, answer)`` of every row; a row without both stops loading with its place named."""
    out = []
    for where, row in read_rows(path, split=split, subset=subset):
        prompt = row_prompt(where, row, prompt_field, prompt_defaults)
        aname, answer = pick(row, answer_field, answer_defaults)
        if answer is None or (isinstance(answer, str) and not answer.strip()) or isinstance(answer, (dict, list)):
            what = "missing" if answer is None else repr(answer)[:40]
            raise TaskDataError(f"{where}: needs an answer in field {aname!r} (a string or number); found {what} "
                                "(set task.answer_field to the right field)")
        out.append((where, prompt, answer))
    return out
