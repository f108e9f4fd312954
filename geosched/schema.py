"""Strict loading of frozen dataclasses from plain YAML/JSON data.

A small, generic engine used by the config and the plan file: it walks the
dataclass fields, checks types (``int``, ``float``, ``str``, ``bool``,
``Literal``, ``Optional``, ``tuple[X, ...]``, nested dataclasses), applies the
bounds declared in each field's metadata, rejects unknown keys, and reports
every problem with its dotted path, the bad value and a remedy::

    cluster.datacenters[1].gpus: must be >= 1 (got 0)

Declare a field with :func:`spec`::

    gpus: int = spec("GPUs in this datacenter", ge=1)
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml

from geosched.errors import ConfigError

_MISSING = dataclasses.MISSING
T = TypeVar("T")


def spec(
    doc: str, default: Any = _MISSING, *, ge: float | None = None, gt: float | None = None, le: float | None = None
) -> Any:
    """A dataclass field with a docstring and optional numeric bounds."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le}
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or None for mutable defaults")
    return dataclasses.field(default=default, metadata=meta)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def load_dataclass(cls: type[T], data: Any, path: str = "", error: type[Exception] = ConfigError) -> T:
    """Build ``cls`` from plain data, raising ``error`` with a dotted path on the first problem."""
    return typing.cast(T, _convert(cls, data, path, error))


def _convert(tp: Any, value: Any, path: str, error: type[Exception]) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path, error)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, path, error)
        for candidate in inner:
            try:
                return _convert(candidate, value, path, error)
            except error:
                continue
        raise error(f"{path}: expected {_type_name(tp)} (got {_describe(value)})")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            raise error(f"{path}: must be one of {', '.join(repr(a) for a in allowed)} (got {_describe(value)}){extra}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise error(f"{path}: expected a list (got {_describe(value)})")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]", error) for i, v in enumerate(value))
        if len(value) != len(args):
            raise error(f"{path}: expected a list of {len(args)} items (got {len(value)})")
        return tuple(_convert(a, v, f"{path}[{i}]", error) for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if not isinstance(value, bool):
            raise error(f"{path}: expected true or false (got {_describe(value)})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise error(f"{path}: expected an integer (got {_describe(value)})")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{path}: expected a number (got {_describe(value)})")
        return float(value)
    if tp is str:
        if not isinstance(value, str) or not value:
            raise error(f"{path}: expected a non-empty string (got {_describe(value)})")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported schema type {tp!r} at {path}")


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _convert_dataclass(cls: type, value: Any, path: str, error: type[Exception]) -> Any:
    if not isinstance(value, dict):
        raise error(
            f"{path or 'top level'}: expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(cls))} "
            f"(got {_describe(value)})"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in value:
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else f"; allowed keys: {', '.join(fields)}"
            raise error(f"{_join(path, key)}: unknown key{extra}")
    kwargs = {}
    for name, field in fields.items():
        sub = _join(path, name)
        if name not in value:
            if field.default is _MISSING and field.default_factory is _MISSING:
                doc = field.metadata.get("doc", "")
                raise error(f"{sub}: missing required field ({doc})" if doc else f"{sub}: missing required field")
            continue
        converted = _convert(hints[name], value[name], sub, error)
        _check_bounds(field, converted, sub, error)
        kwargs[name] = converted
    return cls(**kwargs)


def _check_bounds(field: dataclasses.Field[Any], value: Any, path: str, error: type[Exception]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    meta = field.metadata
    if meta.get("ge") is not None and value < meta["ge"]:
        raise error(f"{path}: must be >= {meta['ge']:g} (got {value})")
    if meta.get("gt") is not None and value <= meta["gt"]:
        raise error(f"{path}: must be > {meta['gt']:g} (got {value})")
    if meta.get("le") is not None and value > meta["le"]:
        raise error(f"{path}: must be <= {meta['le']:g} (got {value})")


def read_yaml_file(path: str, error: type[Exception], missing_hint: str, max_bytes: int | None = None) -> Any:
    """Parse a YAML file with ``yaml.safe_load``; any problem raises ``error`` naming the file (and line).

    ``missing_hint`` finishes the message for a file that does not exist;
    ``max_bytes`` refuses larger files before reading them.
    """
    try:
        if max_bytes is not None and os.path.getsize(path) > max_bytes:
            raise error(f"{path}: larger than {max_bytes >> 20} MiB; not a file geosched wrote")
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except FileNotFoundError:
        raise error(f"{path}: no such file; {missing_hint}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise error(f"{path}:{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read ({exc})") from None


def dump_dataclass(obj: Any) -> Any:
    """Turn a dataclass tree into plain dicts/lists that :func:`load_dataclass` reads back."""
    if dataclasses.is_dataclass(obj):
        return {f.name: dump_dataclass(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (tuple, list)):
        return [dump_dataclass(v) for v in obj]
    return obj


def field_docs(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default, doc) for every field, recursively: the config reference table."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        default = "required" if f.default is _MISSING else repr(dump_dataclass(f.default))
        rows.append((path, _type_name(tp), default, f.metadata.get("doc", "")))
        inner = tp
        if typing.get_origin(tp) is tuple:
            inner = typing.get_args(tp)[0]
            path += "[]"
        if typing.get_origin(inner) in (Union, types.UnionType):
            inner = next((a for a in typing.get_args(inner) if a is not type(None)), inner)
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            rows.extend(field_docs(inner, path + "."))
    return rows
