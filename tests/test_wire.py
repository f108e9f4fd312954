"""The wire format: headers with strict limits, dtype names, zero-copy byte views, one-copy receive."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from geosched.errors import ProtocolError
from geosched.wire import (
    DTYPES,
    MAX_HEADER_BYTES,
    check_tensor_spec,
    checksum,
    contiguous_cpu,
    decode_header,
    dtype_from_name,
    dtype_to_name,
    encode_header,
    join_maps,
    require,
    require_int,
    require_shape,
    show,
    tensor_bytes,
    tensor_from_buffer,
)


def test_every_plain_dtype_round_trips_by_name() -> None:
    for name, dtype in DTYPES.items():
        assert dtype_to_name(dtype) == name and dtype_from_name(name) is dtype
    assert {"float32", "bfloat16", "float16", "int64", "bool", "float8_e4m3fn", "complex64"} <= set(DTYPES)
    with pytest.raises(ProtocolError, match="quantized"):
        dtype_to_name(torch.qint8)
    with pytest.raises(ProtocolError, match="unknown dtype 'float33'"):
        dtype_from_name("float33")


def test_header_round_trip_and_limits() -> None:
    header = {"v": 1, "type": "data", "shape": [2, 3], "crc": 7}
    assert decode_header(encode_header(header)) == header
    with pytest.raises(ProtocolError, match="over the limit"):
        encode_header({"blob": "x" * MAX_HEADER_BYTES})
    with pytest.raises(ProtocolError, match="over the limit"):
        decode_header(b"\x80" * (MAX_HEADER_BYTES + 1))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode_header(encode_header(header)[:-3])  # truncated
    with pytest.raises(ProtocolError, match="must be a msgpack map"):
        decode_header(msgpack.packb([1, 2, 3]))
    with pytest.raises(ProtocolError, match="holds a string of 300 bytes; a header's may have at most 256"):
        decode_header(msgpack.packb({"s": "y" * 300}))  # string over MAX_HEADER_STR, named as such
    with pytest.raises(ProtocolError, match="holds a list of 100 items; a header's may have at most 64"):
        decode_header(msgpack.packb({"a": list(range(100))}))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode_header(msgpack.packb({1: 2}))  # non-string keys
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode_header(msgpack.packb({"x": msgpack.ExtType(1, b"pickle?")}))


def test_nesting_is_bounded_and_wire_values_print_short() -> None:
    nested = {"v": [[{"k": 1}]], "shape": [2, 3]}  # four levels, counting the header map: allowed
    assert decode_header(encode_header(nested)) == nested
    bomb = b"\x81\xa1v" + b"\x91" * 1000 + b"\x00"  # {"v": [[[...]]]}, 1,005 bytes
    with pytest.raises(ProtocolError, match="deeper than"):
        decode_header(bomb)
    with pytest.raises(ProtocolError, match="deeper than"):
        decode_header(encode_header({"v": 1, "m": {"a": {"b": [[0]]}}}))  # five
    deep: list = []
    for _ in range(100_000):  # deeper than any recursion limit: show never walks into it
        deep = [deep]
    assert show(deep) == "<list>"
    assert show("x" * 100) == repr("x" * 100)[:20]
    assert show(7) == "7" and show(None) == "None"


def test_field_validators_name_the_field() -> None:
    header = {"n": 5, "flag": True, "shape": [2, -1], "big": [1] * 20}
    assert require_int(header, "n", 0, 9) == 5
    with pytest.raises(ProtocolError, match=r"'n' = 5 outside \[6, 9\]"):
        require_int(header, "n", 6, 9)
    with pytest.raises(ProtocolError, match="'flag' missing or not int"):
        require_int(header, "flag")  # a bool is not an int here
    with pytest.raises(ProtocolError, match="'missing' missing"):
        require(header, "missing", str)
    for key in ("shape", "big"):
        with pytest.raises(ProtocolError, match=f"'{key}' must be a list"):
            require_shape(header, key)


def test_tensor_spec_is_checked_before_allocation() -> None:
    assert check_tensor_spec(torch.bfloat16, [3, 4], max_bytes=100, nbytes=24) == 24
    with pytest.raises(ProtocolError, match="says 25 bytes"):
        check_tensor_spec(torch.bfloat16, [3, 4], max_bytes=100, nbytes=25)
    with pytest.raises(ProtocolError, match="over the limit of 100 bytes"):
        check_tensor_spec(torch.float64, [1 << 20, 1 << 20], max_bytes=100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.float8_e5m2])
def test_bytes_view_is_zero_copy_and_receive_is_bit_exact(dtype: torch.dtype) -> None:
    source = (torch.randn(6, 5) * 50).to(dtype)
    view = tensor_bytes(source)
    assert view.readonly and len(view) == source.numel() * dtype.itemsize
    assert np.frombuffer(view, np.uint8).ctypes.data == source.data_ptr()  # same memory, no copy
    strided = contiguous_cpu(source.t())  # non-contiguous: one copy to make it contiguous
    out = tensor_from_buffer(bytes(tensor_bytes(strided)), dtype, strided.shape)
    assert torch.equal(out.view(torch.uint8), strided.view(torch.uint8))
    into = torch.empty(5, 6, dtype=dtype)
    assert tensor_from_buffer(tensor_bytes(strided), dtype, [5, 6], out=into) is into
    with pytest.raises(ProtocolError, match="out= is"):
        tensor_from_buffer(tensor_bytes(strided), dtype, [5, 6], out=torch.empty(30, dtype=dtype))


def test_empty_and_scalar_tensors() -> None:
    empty = torch.empty(0, 3, dtype=torch.float16)
    assert len(tensor_bytes(empty)) == 0
    assert tensor_from_buffer(b"", torch.float16, [0, 3]).shape == (0, 3)
    scalar = torch.tensor(3.5, dtype=torch.float64)
    assert tensor_from_buffer(tensor_bytes(scalar), torch.float64, []).item() == 3.5
    with pytest.raises(ProtocolError, match="payload is 7 bytes, expected 8"):
        tensor_from_buffer(b"\0" * 7, torch.float64, [])


def test_join_maps_packs_shared_fields_once() -> None:
    shared = {f"field{i}": i for i in range(14)}
    for extra in ({"offset": 0}, {"offset": 1 << 40, "crc": -1, "tx": 7}):  # fixmap, then map16 when joined
        joined = join_maps(encode_header(shared), len(shared), encode_header(extra), len(extra))
        assert decode_header(joined) == {**shared, **extra}
    with pytest.raises(ProtocolError, match="over the limit of 64"):
        join_maps(b"\x80", 60, b"\x80", 5)


def test_checksum_is_crc32c() -> None:
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value
    data = np.arange(1000, dtype=np.uint8)
    assert checksum(memoryview(data)) == checksum(data.tobytes())
