"""Hardened YAML reading for every config and plan: hostile text is refused in one line, quickly
(and :func:`dump_yaml`, the writer of both; :func:`write_atomically` puts a written file in place whole).

``yaml.safe_load`` is safe against code execution but not against size: a
3 KB alias bomb (``b: [*a, *a, ...]`` nested ten deep) stands for billions of
values, 5,000 levels of ``[`` overflow the recursion limit, a duplicated key
silently wins, ``.nan`` slips into arithmetic. :func:`load_yaml` parses with
libyaml's event parser (the pure-Python one where libyaml is missing) and
composes the document itself, counting as it goes, so every limit below is
checked before any Python object is built:

* the text: at most ``max_bytes`` bytes (files are never read past it: :func:`read_bounded`, which the
  other readers of hostile files share), UTF-8,
  no NUL bytes; tabs get their own message;
* nesting: at most ``max_depth`` levels of lists and mappings (the schema's own
  depth, see :func:`geosched.schema.schema_depth`);
* aliases: at most ``max_aliases`` uses, none pointing into its own anchor, and
  the document fully expanded stays within ``max_nodes`` values;
* keys: plain scalars, each once per mapping (the message names both lines);
* scalars: at most ``max_scalar_chars`` characters, integers at most 30 digits,
  floats finite.

Each refusal raises the caller's error class (:class:`~geosched.errors.ConfigError`,
:class:`~geosched.errors.PlanError`, ...) with ``source``, the line and the dotted
path: ``plan.yaml: line 4: cluster.datacenters[0]: duplicate key 'gpus' (first on line 3); keep one``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

_FLOAT_TAG = "tag:yaml.org,2002:float"
_INT_TAG = "tag:yaml.org,2002:int"
_STR_TAG = "tag:yaml.org,2002:str"
MAX_INT_DIGITS = 30


@dataclass(frozen=True)
class YamlLimits:
    """What one YAML document may contain; the defaults fit a config file."""

    max_bytes: int = 1 << 20
    max_depth: int = 8
    max_nodes: int = 100_000
    max_aliases: int = 200
    max_scalar_chars: int = 4096


def short(value: object, limit: int = 60) -> str:
    """A repr of ``value`` at most about ``limit`` characters, cut BEFORE it is built.

    Strings and bytes are sliced first; lists and mappings are described by
    their size; huge integers by their digit count. Never costs more than
    ``limit`` characters of work, whatever ``value`` is.
    """
    if isinstance(value, (str, bytes)):
        text = repr(value[:limit])
        if len(value) > limit:
            return f"{text[: limit - 3]}... ({len(value)} characters)"
        return text
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        if abs(value) < 10**15:
            return str(value)
        return f"{float(value):.3g}" if value.bit_length() < 1000 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return f"a mapping of {len(value)} key{'s' if len(value) != 1 else ''}"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    return f"a {type(value).__name__}"


def one_line(text: str, limit: int = 160) -> str:
    """``text`` (a library's message) on one line, non-printable characters escaped, cut to ``limit``."""
    text = " ".join(text[: limit * 2].split())
    text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Refused(Exception):
    """Raised inside the composer; :func:`load_yaml` turns it into the caller's error class."""

    def __init__(self, line: int | None, message: str):
        super().__init__(message)
        self.line, self.message = line, message


def _yaml11_surprise(text: str) -> str | None:
    """Why a plain number means something else in YAML 1.1 than it looks (base 60, octal, binary, digits
    grouped with underscores: YAML 1.2 reads those as text), or None."""
    digits = text.lstrip("+-").replace("_", "")
    if "_" in text:
        return f"{short(text, 20)[1:-1]} is read as {digits} in YAML 1.1 (underscores dropped); write {digits}"
    if digits[:2].lower() == "0b":
        return f"{short(text, 20)[1:-1]} is a binary number in YAML 1.1; write it in decimal"
    if ":" in digits:
        return f"{short(text, 20)[1:-1]} is a base-60 number in YAML 1.1; write the number itself, or quote a text"
    if len(digits) > 1 and digits[0] == "0" and digits.isdigit():
        return f"{short(text, 20)[1:-1]} is an octal number in YAML 1.1; write it without the leading zero"
    return None


class _BoundedComposer:
    """Composer of one document that counts depth, aliases and values, and refuses duplicates."""

    limits: YamlLimits
    check_event: Any
    get_event: Any
    peek_event: Any
    resolve: Any
    construct_object: Any

    def _init_bounds(self, limits: YamlLimits) -> None:
        self.limits = limits
        self.anchors: dict[str, Node] = {}
        self._sizes: dict[int, int] = {}  # id(anchored node) -> values it expands to (set once complete)
        self._path: list[str] = []
        self._nodes = 0
        self._aliases = 0

    def _where(self) -> str:
        text = ""
        for part in self._path:
            text += part if part.startswith("[") or not text else "." + part
        return f"{text}: " if text else ""

    def _refuse(self, mark: Any, message: str) -> _Refused:
        return _Refused(mark.line + 1 if mark is not None else None, self._where() + message)

    def _charge(self, count: int, mark: Any, alias: str | None = None) -> None:
        self._nodes += count
        if self._nodes > self.limits.max_nodes:
            if alias is not None:
                raise self._refuse(
                    mark,
                    f"alias *{alias} expands the document past {self.limits.max_nodes} values "
                    "(an alias bomb?); write the values out",
                )
            raise self._refuse(mark, f"more than {self.limits.max_nodes} values; larger than any config or plan")

    def get_single_node(self) -> Node | None:
        self.get_event()  # stream start
        node = None
        if not self.check_event(StreamEndEvent):
            self.get_event()  # document start
            node, _ = self._compose(0)
            self.get_event()  # document end
        if not self.check_event(StreamEndEvent):
            event = self.get_event()
            raise _Refused(event.start_mark.line + 1, "a second YAML document ('---'); give one document per file")
        self.get_event()
        return node

    def _compose(self, depth: int) -> tuple[Node, int]:
        """(node, values it expands to) for the next node."""
        if self.check_event(AliasEvent):
            event = self.get_event()
            self._aliases += 1
            if self._aliases > self.limits.max_aliases:
                raise self._refuse(
                    event.start_mark, f"more than {self.limits.max_aliases} aliases (*name); write the values out"
                )
            target = self.anchors.get(event.anchor)
            if target is None:
                raise self._refuse(event.start_mark, f"alias *{short(event.anchor, 40)[1:-1]} has no anchor before it")
            size = self._sizes.get(id(target))
            if size is None:
                raise self._refuse(event.start_mark, f"alias *{event.anchor} points into its own anchor (a cycle)")
            self._charge(size, event.start_mark, short(event.anchor, 40)[1:-1])
            return target, size
        event = self.peek_event()
        anchor = event.anchor
        if anchor is not None and anchor in self.anchors:
            raise self._refuse(event.start_mark, f"anchor &{short(anchor, 40)[1:-1]} defined twice; rename one")
        self._charge(1, event.start_mark)
        node: Node
        if self.check_event(ScalarEvent):
            node, size = self._scalar(), 1
        elif self.check_event(SequenceStartEvent, MappingStartEvent):
            if depth + 1 > self.limits.max_depth:
                raise self._refuse(
                    event.start_mark,
                    f"nested deeper than {self.limits.max_depth} levels of lists and mappings, "
                    "deeper than any field; flatten it",
                )
            if self.check_event(SequenceStartEvent):
                node, size = self._sequence(anchor, depth + 1)
            else:
                node, size = self._mapping(anchor, depth + 1)
        else:  # pragma: no cover - the parser emits nothing else here
            raise self._refuse(event.start_mark, f"unexpected {type(event).__name__}")
        if anchor is not None:
            self.anchors[anchor] = node
            self._sizes[id(node)] = size
        return node, size

    def _scalar(self) -> ScalarNode:
        event = self.get_event()
        tag = event.tag
        if tag is None or tag == "!":
            tag = self.resolve(ScalarNode, event.value, event.implicit)
        value: str = event.value
        if len(value) > self.limits.max_scalar_chars:
            raise self._refuse(
                event.start_mark,
                f"a value of {len(value)} characters; no field takes more than {self.limits.max_scalar_chars}",
            )
        node = ScalarNode(tag, value, event.start_mark, event.end_mark, style=event.style)
        if tag in (_INT_TAG, _FLOAT_TAG) and event.tag is None:
            surprise = _yaml11_surprise(value)
            if surprise is not None:
                raise self._refuse(event.start_mark, surprise)
        if tag == _INT_TAG and len(value) > MAX_INT_DIGITS:
            raise self._refuse(event.start_mark, f"an integer of {len(value)} digits; far beyond any field's bound")
        if tag == _FLOAT_TAG:
            number = yaml.constructor.SafeConstructor.construct_yaml_float(self, node)  # type: ignore[arg-type]
            if not math.isfinite(number):
                raise self._refuse(
                    event.start_mark, f"{short(value, 20)[1:-1]} is not a finite number; give a plain number"
                )
        return node

    def _sequence(self, anchor: str | None, depth: int) -> tuple[SequenceNode, int]:
        start = self.get_event()
        tag = start.tag
        if tag is None or tag == "!":
            tag = self.resolve(SequenceNode, None, start.implicit)
        node = SequenceNode(tag, [], start.start_mark, None, flow_style=start.flow_style)
        if anchor is not None:
            self.anchors[anchor] = node  # an alias to it from inside is a cycle: _sizes has no entry yet
        size = 1
        while not self.check_event(SequenceEndEvent):
            self._path.append(f"[{len(node.value)}]")
            child, child_size = self._compose(depth)
            self._path.pop()
            node.value.append(child)
            size += child_size
        node.end_mark = self.get_event().end_mark
        return node, size

    def _mapping(self, anchor: str | None, depth: int) -> tuple[MappingNode, int]:
        start = self.get_event()
        tag = start.tag
        if tag is None or tag == "!":
            tag = self.resolve(MappingNode, None, start.implicit)
        node = MappingNode(tag, [], start.start_mark, None, flow_style=start.flow_style)
        if anchor is not None:
            self.anchors[anchor] = node
        size = 1
        seen: dict[Any, int] = {}
        while not self.check_event(MappingEndEvent):
            event = self.peek_event()
            if not self.check_event(ScalarEvent):
                raise self._refuse(event.start_mark, "a key must be a plain name, not a list, mapping or alias")
            key = self._scalar()
            self._charge(1, event.start_mark)
            size += 1
            value: Any = key.value
            if key.tag != _STR_TAG:  # 1 and 0x1 are the same key
                try:
                    value = self.construct_object(key)
                    hash(value)
                except (yaml.YAMLError, TypeError):
                    value = (key.tag, key.value)
            line = event.start_mark.line + 1
            if value in seen and key.tag != "tag:yaml.org,2002:merge":
                raise self._refuse(
                    event.start_mark, f"duplicate key {short(key.value, 40)} (first on line {seen[value]}); keep one"
                )
            seen[value] = line
            self._path.append(short(key.value, 40) if not key.value.isidentifier() else key.value)
            child, child_size = self._compose(depth)
            self._path.pop()
            node.value.append((key, child))
            size += child_size
        node.end_mark = self.get_event().end_mark
        return node, size


class _Resolver(yaml.resolver.Resolver):
    """PyYAML's YAML 1.1 resolver, plus YAML 1.2's floats with an exponent and no dot or sign (``3e-3``, ``1e9``,
    ``2.5e4``), which YAML 1.1 reads as strings: a learning rate written ``3e-3`` is the number a user means."""


_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_Resolver.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+.0123456789"))


if getattr(yaml, "__with_libyaml__", False):
    from yaml._yaml import CParser as _EventParser  # what yaml.cyaml re-exports

    class _Loader(_BoundedComposer, _EventParser, yaml.constructor.SafeConstructor, _Resolver):
        def __init__(self, text: str, limits: YamlLimits):
            _EventParser.__init__(self, text)
            yaml.constructor.SafeConstructor.__init__(self)
            _Resolver.__init__(self)
            self._init_bounds(limits)

else:  # pragma: no cover - libyaml ships with the PyYAML wheels

    class _Loader(  # type: ignore[no-redef]
        _BoundedComposer,
        yaml.reader.Reader,
        yaml.scanner.Scanner,
        yaml.parser.Parser,
        yaml.constructor.SafeConstructor,
        _Resolver,
    ):
        def __init__(self, text: str, limits: YamlLimits):
            yaml.reader.Reader.__init__(self, text)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            _Resolver.__init__(self)
            self._init_bounds(limits)


_Dumper: Any = type("_Dumper", (getattr(yaml, "CSafeDumper", yaml.SafeDumper),), {})  # libyaml: 2.4x faster
_Dumper.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+.0123456789"))  # quotes a name like "1e3"


def dump_yaml(data: Any, **options: Any) -> str:
    """``yaml.safe_dump`` through libyaml when PyYAML has it (the same text, written faster)."""
    return str(yaml.dump(data, Dumper=_Dumper, sort_keys=False, **options))


def _line(text: str, number: int) -> str:
    """Line ``number`` (0-based) of ``text``, found without splitting the whole text."""
    start = 0
    for _ in range(number):
        start = text.find("\n", start) + 1
        if start == 0:
            return ""
    end = text.find("\n", start)
    return text[start : end if end >= 0 else len(text)]


def _syntax_error(source: str, text: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = str(getattr(exc, "problem", None) or exc)
    line = _line(text, mark.line) if mark is not None else ""
    if "\t" in line[: mark.column + 1 if mark is not None else 0] or "'\\t'" in problem:
        return f"{source}: {where}a tab character; YAML is indented with spaces only"
    if "maximum nesting depth" in problem:
        return f"{source}: {where}nested far deeper than any field; flatten it"
    if isinstance(exc, yaml.reader.ReaderError):
        char = exc.character
        code = char if isinstance(char, int) else ord(char) if isinstance(char, str) and len(char) == 1 else 0
        return f"{source}: binary data (byte 0x{code:02x} at offset {exc.position}), not YAML text"
    return f"{source}: {where}not valid YAML ({one_line(problem)})"


def load_yaml(text: str | bytes, source: str, error: type[Exception], limits: YamlLimits = YamlLimits()) -> Any:
    """Parse one YAML document within ``limits``; anything else raises ``error`` in one line naming ``source``."""
    if len(text) > limits.max_bytes:
        raise error(f"{source}: larger than {limits.max_bytes} bytes, the most a config or plan may have")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(
                f"{source}: binary data (byte 0x{text[exc.start]:02x} at offset {exc.start}), not UTF-8 YAML text"
            ) from None
    nul = text.find("\0")
    if nul >= 0:
        raise error(f"{source}: binary data (a NUL byte at offset {nul}), not YAML text")
    loader = _Loader(text, limits)
    try:
        node = loader.get_single_node()
        return None if node is None else loader.construct_document(node)
    except _Refused as exc:
        where = f"line {exc.line}: " if exc.line is not None else ""
        raise error(f"{source}: {where}{exc.message}") from None
    except yaml.YAMLError as exc:
        raise error(_syntax_error(source, text, exc)) from None
    except RecursionError:  # not reachable within max_depth; kept so no traceback can escape
        raise error(f"{source}: nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml_file(
    path: str | os.PathLike[str], error: type[Exception], missing_hint: str, limits: YamlLimits = YamlLimits()
) -> Any:
    """Read and parse a YAML file within ``limits``, never reading more than ``limits.max_bytes + 1`` bytes.

    ``missing_hint`` finishes the message for a file that does not exist.
    """
    data = read_bounded(
        path,
        limits.max_bytes,
        error,
        too_big=f"larger than {limits.max_bytes} bytes, the most a config or plan may have",
        missing=f"no such file; {missing_hint}",
    )
    return load_yaml(data, os.fspath(path), error, limits)


def file_kind(mode: int) -> str:
    """What a ``stat`` mode is, in words: ``"file"`` for a regular file, else ``"directory"``, ``"FIFO"``..."""
    for test, kind in (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return kind
    return "special file"


def exposed_secret(path: str | os.PathLike[str], mode: int) -> str | None:
    """``"PATH is readable by others (mode M): run chmod 600 PATH"`` when a secret file's ``stat`` mode gives its
    group or others any access, else None: one wording for every key, token and TLS key file."""
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    path = os.fspath(path)
    return f"{path} is readable by others (mode {stat.S_IMODE(mode):04o}): run chmod 600 {path}"


def write_atomically(path: str, text: str) -> None:
    """``text`` into ``path`` via a temporary file beside it and a rename: a reader (or a crash) never sees half a
    file, and a file that was there stays whole until the new one is."""
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{secrets.token_hex(4)}")  # fits any file name
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_bounded(
    path: str | os.PathLike[str],
    max_bytes: int,
    error: Callable[[str], Exception],
    *,
    too_big: str,
    missing: str | None = None,
    unreadable: str = "cannot read",
    hint: str = "",
) -> bytes:
    """The bytes of a file that may be hostile (a config, plan, checkpoint's metadata, calibration), never
    reading more than ``max_bytes + 1`` (enough to know it is too large); else ``error`` with one line naming
    the file: ``"<path>: <too_big>"`` beyond the bound, ``"<path>: <missing>"`` if there is no such file
    (None: as any file that cannot be read), ``"<path>: <unreadable> (<why>)<hint>"`` if it cannot be read."""
    path = os.fspath(path)
    try:
        # non-blocking open: a FIFO without a writer would block open() forever; it is refused below instead
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            kind = file_kind(os.fstat(fd).st_mode)
            if kind != "file":
                raise error(f"{path}: {unreadable} (a {kind}, not a regular file){hint}")
            os.set_blocking(fd, True)
            with open(fd, "rb", closefd=False) as fh:  # reads on until max_bytes + 1 bytes or the end
                data = fh.read(max_bytes + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        if missing is not None and isinstance(exc, FileNotFoundError):
            raise error(f"{path}: {missing}") from None
        raise error(f"{path}: {unreadable} ({one_line(exc.strerror or str(exc))}){hint}") from None
    if len(data) > max_bytes:
        raise error(f"{path}: {too_big}")
    return data
