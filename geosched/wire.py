"""Wire format shared by the WAN links and the prefill protocol.

A message on the wire is a small msgpack *header* frame (a map with string
keys) followed by raw byte frames. Nothing is ever unpickled: headers are
decoded with strict msgpack limits and validated before anything is
allocated, and tensor bytes travel as raw frames that are viewed without a
copy on the way out and copied exactly once into the destination on the way
in.

This module is generic: it knows headers, dtypes, tensor byte views and
checksums, not links or prefill requests. Example::

    header = {"v": 1, "dtype": dtype_to_name(t.dtype), "shape": list(t.shape)}
    frames = [encode_header(header), tensor_bytes(t)]          # send with copy=False
    ...
    h = decode_header(frames[0])
    dtype = dtype_from_name(require(h, "dtype", str))
    nbytes = check_tensor_spec(dtype, require_shape(h, "shape"), max_bytes=1 << 30)
    out = tensor_from_buffer(frames[1], dtype, h["shape"])     # one copy
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, overload

import crc32c
import msgpack
import numpy as np
import torch

from geosched.errors import ProtocolError

MAX_HEADER_BYTES = 4096  # a header frame longer than this is refused before decoding
MAX_HEADER_STR = 256  # longest string (or bin) value allowed inside a header
MAX_HEADER_ITEMS = 64  # most keys in the header map / items in one of its arrays
MAX_HEADER_DEPTH = 4  # the map, its values, their items, theirs: deeper nesting is refused (it is never sent)
MAX_DIMS = 16  # most dimensions of a tensor shape

_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})
T = TypeVar("T")


def _all_dtypes() -> dict[str, torch.dtype]:
    """Every plain torch dtype by its canonical name ('float32', 'bfloat16', 'bool', ...)."""
    found: dict[str, torch.dtype] = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            name = str(value).removeprefix("torch.")
            if name not in _QUANTIZED:
                found[name] = value
    return found


DTYPES: dict[str, torch.dtype] = _all_dtypes()
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_to_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; raises ProtocolError for quantized dtypes."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ProtocolError(
            f"dtype {dtype} cannot be sent raw (quantized tensors carry scale/zero point): "
            "send tensor.int_repr() and the quantization parameters instead"
        )
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype named on the wire; raises ProtocolError for an unknown name."""
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"unknown dtype {str(name)[:40]!r} in header (known: float32, bfloat16, int64, bool, ...)")
    return dtype


def encode_header(header: Mapping[str, Any]) -> bytes:
    """Pack a header map with msgpack; raises ProtocolError if it is over MAX_HEADER_BYTES."""
    data = msgpack.packb(header, use_bin_type=True)
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(data)} bytes, over the limit of {MAX_HEADER_BYTES}")
    return data


def decode_header(data: bytes | memoryview, *, max_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """Decode a header frame with strict limits; ProtocolError if it is not a small msgpack map."""
    if len(data) > max_bytes:
        raise ProtocolError(f"header frame is {len(data)} bytes, over the limit of {max_bytes}")
    try:
        header = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=MAX_HEADER_STR,
            max_bin_len=MAX_HEADER_STR,
            max_array_len=MAX_HEADER_ITEMS,
            max_map_len=MAX_HEADER_ITEMS,
            max_ext_len=0,
        )
    except ValueError as exc:  # its bounds: "3000 exceeds max_str_len(256)"
        bound = re.fullmatch(r"(\d+) exceeds max_(str|bin|array|map)_len\((\d+)\)", str(exc))
        if bound is None:
            raise ProtocolError(f"header frame is not valid msgpack ({type(exc).__name__})") from None
        what, unit = {
            "str": ("string", "bytes"),
            "bin": ("byte string", "bytes"),
            "array": ("list", "items"),
            "map": ("map", "entries"),
        }[bound.group(2)]
        raise ProtocolError(
            f"header frame holds a {what} of {bound.group(1)} {unit}; a header's may have at most {bound.group(3)}"
        ) from None
    except Exception as exc:  # msgpack raises a zoo of types for garbage; all mean the same here
        raise ProtocolError(f"header frame is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    for value in header.values():  # hot path: most values are scalars
        if type(value) is list or type(value) is dict:
            _check_depth(value)
    return header


def _check_depth(value: list[Any] | dict[Any, Any]) -> None:
    """ProtocolError if containers nest deeper than MAX_HEADER_DEPTH (counting the header map): a frame of a
    few KB can nest a thousand lists deep, and anything that prints or compares such a value recursively
    would exhaust the stack. Iterative, so checking cannot."""
    stack: list[tuple[Any, int]] = [(value, 2)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_HEADER_DEPTH:
            raise ProtocolError(f"header nests containers deeper than {MAX_HEADER_DEPTH} levels")
        children = item.values() if type(item) is dict else item
        stack.extend((child, depth + 1) for child in children if type(child) is list or type(child) is dict)


def show(value: Any, limit: int = 20) -> str:
    """A value from the wire for an error message: a scalar's text cut to ``limit`` characters, else only its
    type (never the whole of a container, however it nests)."""
    if value is None or type(value) in (bool, int, float, str):
        return repr(value)[:limit]
    return f"<{type(value).__name__}>"


def join_maps(first: bytes, first_items: int, second: bytes, second_items: int) -> bytes:
    """One packed msgpack map of the items of two packed maps (with ``*_items`` entries; keys must differ).

    Lets a sender pack the fields shared by many headers once and only the few that change per header.
    """
    items = first_items + second_items
    if items > MAX_HEADER_ITEMS:
        raise ProtocolError(f"header of {items} fields, over the limit of {MAX_HEADER_ITEMS}")
    head = bytes((0x80 | items,)) if items < 16 else b"\xde" + items.to_bytes(2, "big")
    data = b"".join((head, first[_map_head_len(first_items) :], second[_map_head_len(second_items) :]))
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(data)} bytes, over the limit of {MAX_HEADER_BYTES}")
    return data


def _map_head_len(items: int) -> int:
    return 1 if items < 16 else 3  # fixmap, or map16 (MAX_HEADER_ITEMS < 2**16)


@overload
def require(header: Mapping[str, Any], key: str, kind: type[T]) -> T: ...
@overload
def require(header: Mapping[str, Any], key: str, kind: tuple[type, ...]) -> Any: ...
def require(header: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``header[key]`` if present and of type ``kind`` (bool is never an int); else ProtocolError."""
    value = header.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is None or not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"header field {key!r} missing or not {'/'.join(k.__name__ for k in kinds)}")
    return value


def require_int(header: Mapping[str, Any], key: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    """An integer header field within [lo, hi]; else ProtocolError."""
    value = require(header, key, int)
    if not lo <= value <= hi:
        raise ProtocolError(f"header field {key!r} = {value} outside [{lo}, {hi}]")
    return value


def require_shape(header: Mapping[str, Any], key: str = "shape") -> list[int]:
    """A tensor shape field: a list of at most MAX_DIMS non-negative ints; else ProtocolError."""
    shape = require(header, key, list)
    if len(shape) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"header field {key!r} must be a list of at most {MAX_DIMS} non-negative ints")
    return shape


def tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a contiguous tensor of this dtype and shape."""
    return math.prod(shape) * dtype.itemsize


def check_tensor_spec(dtype: torch.dtype, shape: Sequence[int], *, max_bytes: int, nbytes: int | None = None) -> int:
    """Validate a (dtype, shape[, total bytes]) triple before allocating; returns the byte size.

    Raises ProtocolError when the size exceeds ``max_bytes`` or disagrees with ``nbytes``.
    """
    size = tensor_nbytes(dtype, shape)
    if size > max_bytes:
        raise ProtocolError(f"tensor of {size} bytes is over the limit of {max_bytes} bytes")
    if nbytes is not None and nbytes != size:
        raise ProtocolError(f"shape {list(shape)} x {dtype.itemsize} bytes = {size}, but header says {nbytes} bytes")
    return size


def contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if it is a contiguous CPU tensor, else a contiguous CPU copy."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat read-only byte view of a contiguous CPU tensor (no copy; call contiguous_cpu first)."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return byte_array(tensor).data.toreadonly()  # .data: the array's buffer, as memoryview(array) gives it


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A writable flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ProtocolError("destination tensor must be a contiguous CPU tensor")
    if tensor.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def empty_tensor(dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A new uninitialised contiguous CPU tensor to receive into."""
    return torch.empty(tuple(shape), dtype=dtype)


def tensor_from_buffer(
    data: bytes | memoryview, dtype: torch.dtype, shape: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy received bytes (exactly once) into ``out`` or a new tensor of dtype/shape.

    Raises ProtocolError when the byte count or ``out``'s dtype/shape disagree.
    """
    nbytes = tensor_nbytes(dtype, shape)
    if len(data) != nbytes:
        raise ProtocolError(f"payload is {len(data)} bytes, expected {nbytes} for {dtype} {list(shape)}")
    if out is None:
        out = empty_tensor(dtype, shape)
    elif out.dtype != dtype or list(out.shape) != list(shape):
        raise ProtocolError(f"out= is {out.dtype} {list(out.shape)} but the message is {dtype} {list(shape)}")
    if nbytes:
        byte_array(out)[:] = np.frombuffer(data, dtype=np.uint8)
    return out


def checksum(data: bytes | memoryview | np.ndarray) -> int:
    """CRC32C of a buffer (hardware accelerated where available)."""
    if isinstance(data, np.ndarray):
        data = data.data  # the same buffer (numpy's stubs make ndarray a Buffer only on Python >= 3.12)
    return crc32c.crc32c(data)
