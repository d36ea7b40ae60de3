"""Reading the text files users hand us (YAML configs, JSONL data) with errors that name the file and line.

``read_text`` (and ``read_jsonl``, line by line) decodes UTF-8 and, on bad bytes, says which line holds them
instead of Python's bare ``UnicodeDecodeError``. ``load_yaml`` parses with PyYAML's safe loader but refuses a
key that appears twice in one mapping (PyYAML keeps the last one silently, so a repeated section would
replace the earlier one) and reads ``1e-6`` as a number, as YAML 1.2 does.

Both raise :class:`TextFileError` (a ``ValueError``); callers wrap it in their own error type.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

import yaml


class TextFileError(ValueError):
    """A file cannot be read, is not UTF-8 text, or is not the YAML it should be."""


def read_text(path: str) -> str:
    """The file's text, decoded as UTF-8 (a byte-order mark is dropped)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TextFileError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TextFileError(f"{path}: line {line} is not UTF-8 text (byte {e.start}: "
                            f"{data[e.start:e.end]!r}, {e.reason}); save the file as UTF-8") from None


def read_jsonl(path: str) -> list[tuple[int, Any]]:
    """``(line number, parsed value)`` of every non-blank line of a JSON-lines file."""
    rows = []
    for n, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise TextFileError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return rows


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe loader that refuses duplicate keys in a mapping and reads ``1e-6`` as a float.

    PyYAML follows YAML 1.1, whose floats need a decimal point (``1.0e-6``), so ``learning_rate: 1e-6`` came
    back as the string ``'1e-6'``; YAML 1.2 (and every other config reader) takes it as a number, and so do we.
    """


_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            seen = first_line.get(key)
        except TypeError:  # an unhashable key: the safe constructor names it below
            continue
        if seen is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice in one mapping (first on line {seen}); YAML would "
                "keep only the last one", key_node.start_mark)
        first_line[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def parse_yaml_value(text: str) -> Any:
    """One value written as YAML (a ``key=value`` override), read like :func:`load_yaml` reads a file."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def load_yaml(path: str) -> Any:
    """Parses a YAML file (UTF-8, no duplicate keys); an empty file is ``None``."""
    stream = io.StringIO(read_text(path))
    stream.name = path  # PyYAML's marks then say the file's name, not "<unicode string>"
    try:
        return yaml.load(stream, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise TextFileError(f"{path}: not valid YAML: {e}") from None
