"""Strict loading of frozen dataclasses from plain YAML/JSON data.

A small, generic engine used by the config and the plan file: it walks the
dataclass fields, checks types (``int``, ``float``, ``str``, ``bool``,
``Literal``, ``Optional``, ``tuple[X, ...]``, nested dataclasses), applies the
bounds declared in each field's metadata, rejects unknown keys, and reports
every problem with its dotted path, the bad value and a remedy::

    cluster.datacenters[1].gpus: must be >= 1 (got 0)

Declare a field with :func:`spec`::

    gpus: int = spec("GPUs in this datacenter", ge=1, le=1_000_000)

Every number has an upper bound (``le``), every string at most ``max_len``
characters (:data:`MAX_STR_LEN` unless given), every list at most
``max_items`` entries (checked before its entries are read), and numbers
must be finite. Messages show at most a short prefix of a bad value
(:func:`geosched.yamlload.short`), never the whole of it. The YAML text itself
is read by :mod:`geosched.yamlload`, nested at most :func:`schema_depth` deep.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, Literal, TypeVar, Union

from geosched.errors import ConfigError
from geosched.yamlload import short

_MISSING = dataclasses.MISSING
T = TypeVar("T")
MAX_STR_LEN = 256
"""The longest string any field takes unless its spec says less."""
MAX_ITEMS = 4096
"""The most entries any list field takes unless its spec says otherwise."""


def spec(
    doc: str,
    default: Any = _MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    max_len: int = MAX_STR_LEN,
    max_items: int = MAX_ITEMS,
) -> Any:
    """A dataclass field with a docstring, numeric bounds, and bounds on its string length or list size."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "max_len": max_len, "max_items": max_items}
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or None for mutable defaults")
    return dataclasses.field(default=default, metadata=meta)


def _describe(value: Any) -> str:
    return short(value)


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


def schema_depth(tp: Any) -> int:
    """Levels of lists and mappings a document of type ``tp`` nests (a mapping of scalars: 1)."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return 1 + max((schema_depth(hints[f.name]) for f in dataclasses.fields(tp)), default=0)
    if origin in (Union, types.UnionType):
        return max(schema_depth(a) for a in typing.get_args(tp))
    if origin is tuple:
        return 1 + max((schema_depth(a) for a in typing.get_args(tp) if a is not Ellipsis), default=0)
    return 0


def _convert(tp: Any, value: Any, path: str, error: type[Exception], meta: Any = None) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path, error)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, path, error, meta)
        for candidate in inner:
            try:
                return _convert(candidate, value, path, error, meta)
            except error:
                continue
        raise error(f"{path}: expected {_type_name(tp)} (got {_describe(value)})")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, (list, dict)) or value not in allowed:
            typed = str(value)[:64].lower() if isinstance(value, (str, int, float)) else ""
            spelled = {str(a).lower(): str(a) for a in allowed}  # INT8: 'int8'
            hint = [spelled[h] for h in difflib.get_close_matches(typed, list(spelled), n=1)]
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            if isinstance(value, bool) and all(isinstance(a, str) for a in allowed):
                extra = "; YAML reads an unquoted yes/no/on/off/true/false as a boolean: write one of those"
            raise error(f"{path}: must be one of {', '.join(repr(a) for a in allowed)} (got {_describe(value)}){extra}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise error(f"{path}: expected a list (got {_describe(value)})")
        most = meta["max_items"] if meta else MAX_ITEMS
        if len(value) > most:
            raise error(f"{path}: at most {most} entries (got {len(value)})")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]", error, meta) for i, v in enumerate(value))
        if len(value) != len(args):
            raise error(f"{path}: expected a list of {len(args)} items (got {len(value)})")
        return tuple(_convert(a, v, f"{path}[{i}]", error, meta) for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if not isinstance(value, bool):
            raise error(f"{path}: expected true or false (got {_describe(value)})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if not (isinstance(value, float) and value.is_integer()):
                raise error(f"{path}: expected an integer (got {_describe(value)})")
            _check_number(value, meta, path, error)
            return int(value)
        _check_number(value, meta, path, error)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{path}: expected a number (got {_describe(value)})")
        if isinstance(value, int) and value.bit_length() > 1000:
            raise error(f"{path}: must be a finite number (got {_describe(value)})")
        if not math.isfinite(value):
            raise error(f"{path}: must be a finite number (got {_describe(value)})")
        _check_number(value, meta, path, error)
        return float(value)
    if tp is str:
        if not isinstance(value, str) or not value:
            quote = "; YAML read a number or true/false: write it in quotes" if isinstance(value, int | float) else ""
            raise error(f"{path}: expected a non-empty string (got {_describe(value)}){quote}")
        most = meta["max_len"] if meta else MAX_STR_LEN
        if len(value) > most:
            raise error(f"{path}: at most {most} characters (got {len(value)}: {_describe(value[:20])})")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported schema type {tp!r} at {path}")


def _join(path: str, key: object) -> str:
    name = key if isinstance(key, str) and key.isidentifier() and len(key) <= 64 else short(key, 40)
    return f"{path}.{name}" if path else name


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
            hint = difflib.get_close_matches(key[:64] if isinstance(key, str) else "", list(fields), n=1)
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
        kwargs[name] = _convert(hints[name], value[name], sub, error, field.metadata)
    return cls(**kwargs)


def _check_number(value: float, meta: Any, path: str, error: type[Exception]) -> None:
    if not meta:
        return
    if meta.get("ge") is not None and value < meta["ge"]:
        raise error(f"{path}: must be >= {meta['ge']:g} (got {_describe(value)})")
    if meta.get("gt") is not None and value <= meta["gt"]:
        raise error(f"{path}: must be > {meta['gt']:g} (got {_describe(value)})")
    if meta.get("le") is not None and value > meta["le"]:
        raise error(f"{path}: must be <= {_bound(meta['le'])} (got {_describe(value)})")


def _bound(limit: float) -> str:
    """``4096``, ``1000000``, ``1e+12``: a bound as a reader would write it."""
    if isinstance(limit, int):
        return str(limit)
    return str(int(limit)) if limit.is_integer() and abs(limit) < 1e10 else f"{limit:g}"


def dump_dataclass(obj: Any) -> Any:
    """Turn a dataclass tree into plain dicts/lists that :func:`load_dataclass` reads back."""
    names = _init_fields(obj.__class__)
    if names is not None:
        return {name: dump_dataclass(getattr(obj, name)) for name in names}
    if isinstance(obj, (tuple, list)):
        return [dump_dataclass(v) for v in obj]
    return obj


@functools.cache
def _init_fields(cls: type) -> tuple[str, ...] | None:
    """The fields a dataclass type is built from (None: not a dataclass), looked up once per type (a plan's
    thousands of ranks are dumped field by field)."""
    if not dataclasses.is_dataclass(cls):
        return None
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


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
