"""Frozen-dataclass schemas read from plain data (YAML, JSON), with errors that name the field.

Under every config of the project (:mod:`dora_jax.config`, :mod:`dora_jax.sim.config`): :func:`from_dict` and
:func:`build` construct dataclasses from nested mappings, checking every key and type; their ``validate``
methods call :func:`fail`. A bad value is a :class:`ConfigError` naming the dotted field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Union

import yaml

from dora_jax.textfiles import parse_yaml_value


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range; ``field``: its dotted field, if any."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def fail(path: str, value: Any, allowed: str) -> None:
    """Raises :class:`ConfigError` (``field`` = ``path``) reading ``config field 'PATH' = VALUE: ALLOWED``.

    ``path``: the dotted field, e.g. ``train.clip_low`` (``paper.64.speedup`` for a mapping's key); ``allowed``:
    what the field accepts, e.g. ``must be > 0``.
    """
    raise ConfigError(f"config field '{path}' = {value!r}: {allowed}", field=path)


def to_plain(obj: Any) -> Any:
    """A dataclass tree as nested plain data (dicts, lists, scalars): what :func:`from_dict` reads back."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            writer = f.metadata.get("to_plain")
            value = getattr(obj, f.name)
            out[f.name] = writer(value) if writer else to_plain(value)
        return out
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    return obj


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        if len(args) == 1:
            return _convert(value, args[0], path)
        for arg in args:  # the first type, in the order written, that takes the value
            try:
                return _convert(value, arg, path)
            except ConfigError:
                pass
        fail(path, value, f"must be {' or '.join(_describe(a) for a in args)}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            fail(path, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(path, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(path, value, "must be a number")
        if not math.isfinite(value):  # no setting means "not a number" or "unbounded" (0 is "off" where allowed)
            fail(path, value, "must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(path, value, "must be a string")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            fail(path, value, "must be a list")
        (item_tp, _) = typing.get_args(tp)
        return tuple(_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:  # a mapping whose keys the config chooses (names, counts); each key is a dotted step
        if not isinstance(value, dict):
            fail(path, value, "must be a mapping")
        key_tp, item_tp = typing.get_args(tp)
        return {_convert(k, key_tp, f"{path}.{k}"): _convert(v, item_tp, f"{path}.{k}") for k, v in value.items()}
    raise TypeError(f"unsupported config field type {tp} at {path}")  # programming error, not user input


def _describe(tp: Any) -> str:
    """A config field type in words, for the error of a field that accepts several."""
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if tp in words:
        return words[tp]
    if typing.get_origin(tp) is tuple:
        return f"a list ({_describe(typing.get_args(tp)[0])} each)"
    return "a mapping"


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Builds dataclass ``cls`` from nested plain ``data`` (``None``: empty), checking every key and type.

    Field types: ``bool``, ``int``, ``float`` (finite; an integer is taken as a float), ``str``, ``tuple[X, ...]``
    (a list), ``dict[K, V]``, a nested dataclass, ``Optional[X]`` and unions ``X | Y`` (the first type written that
    takes the value). A missing key keeps the default; range and cross-field checks are the dataclass's
    ``validate``. Hooks: field metadata ``from_plain`` (and ``to_plain``) reads a field by that function of
    ``(value, path)``; a class attribute ``RETIRED_FIELDS`` maps removed names to the message they are refused with.
    ``path`` is where ``data`` sits, for messages (``""`` at the top).

    Raises:
        ConfigError: naming the first unknown key, or the field whose value has the wrong type.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        fail(path or "<root>", data, f"must be a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names), key=str)
    retired = getattr(cls, "RETIRED_FIELDS", {})
    for name in unknown:
        if name in retired:
            fail(f"{path}.{name}" if path else name, data[name], retired[name])
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"unknown config field '{where}' = {data[unknown[0]]!r}; fields of "
                          f"'{path or '<root>'}' are: {', '.join(names)}", field=where)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        sub = f"{path}.{f.name}" if path else f.name
        reader = f.metadata.get("from_plain")
        kwargs[f.name] = reader(data[f.name], sub) if reader else _convert(data[f.name], hints[f.name], sub)
    return cls(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Applies ``a.b.c=value`` overrides (values parsed as YAML) to nested plain data, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. model.num_layers=4")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            if node.get(p) is None:  # absent, or an empty section (``dora:`` with nothing under it)
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is not a section")
        try:
            node[parts[-1]] = parse_yaml_value(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
    return data


def _override_for(field: str | None, overrides: list[str] | tuple[str, ...]) -> str | None:
    """The last override that set ``field`` (or a section holding it, or a field inside it)."""
    if not field:
        return None
    head, _, last = field.split("[", 1)[0].rpartition(".")
    fields = [f"{head}.{name}" if head else name for name in last.split("/")]  # a rule over two: train.is_low/is_high
    for item in reversed(overrides):
        key = item.split("=", 1)[0].strip()
        if any(key == f or f.startswith(key + ".") or key.startswith(f + ".") for f in fields):
            return item
    return None


def build(cls: type, data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str | None = None):
    """``cls`` from plain ``data`` with ``key=value`` overrides applied, type-checked and validated.

    Raises:
      ConfigError: naming the field, value and what is allowed, prefixed with the override that set it, else
        ``source`` (the file ``data`` came from).
    """
    apply_overrides(data, overrides)
    try:
        out = from_dict(cls, data)
        out.validate()
    except ConfigError as e:
        item = _override_for(e.field, overrides)
        where = f"override {item!r}" if item else source
        raise ConfigError(f"{where}: {e}" if where else str(e), field=e.field) from None
    return out
