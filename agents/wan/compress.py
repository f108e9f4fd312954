"""The torch codec of WAN compression: blocks of 64 values, one fp32 scale each, one byte a value.

The formats and their cost are :mod:`geosched.compression`'s (torch-free, what
the planner prices); this module runs them. A tensor of n values is flattened
and cut into ``nb = ceil(n / 64)`` blocks of :data:`~geosched.compression.BLOCK`
consecutive values (the last one may be short). Each block gets one scale
``max|x| / qmax`` and each value one byte ``x / scale`` in the codec's format:

=========  ======  ================================================  =====================================
codec      qmax    a value                                           error per value (decoded vs sent)
=========  ======  ================================================  =====================================
``int8``   127     ``round(x / scale)`` clamped to [-127, 127]       <= scale / 2
``fp8``    448     ``(x / scale).to(torch.float8_e4m3fn)`` (e4m3)    <= 2^-4 of |x| where |x| / scale >= 2^-6
                                                                     (a normal e4m3 number); <= 2^-10 scale
                                                                     below that (e4m3's subnormals)
=========  ======  ================================================  =====================================

plus the rounding of the decoded value to the tensor's dtype (at most 2^-8 of
it for bf16, 2^-11 for fp16, fp32's own 2^-24 for fp32). A block of zeros has
scale 0 and decodes to zeros. The arithmetic is fp32 whatever the tensor's
dtype, and vectorised over whole blocks: no Python loop over blocks, the same
code on CPU and CUDA (the payload lives on the tensor's device).

**On the wire** a compressed tensor is one uint8 payload of
``compressed_bytes(n x itemsize, itemsize, codec) = 4 nb + n`` bytes: the nb
scales (fp32, the host's byte order like every raw tensor frame, little-endian
on every machine geosched runs on) first, so they stay 4-byte aligned, then the
n value bytes. It travels as an ordinary WanLink message of dtype uint8; the
receiver knows the tensor it expects (the stage boundary: dtype and shape) and
:func:`decode` refuses, in one line and before allocating the decoded tensor,
a payload whose dtype, shape or size (so its scale count) is not that
tensor's, or whose scales are not finite and non-negative. Value bytes are
data, as a raw tensor's are, and not checked. :class:`TensorCodec` is that
agreement for one link (codec, dtype, shape), what
:class:`~agents.stage.transport.LinkTransport` holds per compressed peer.

**NaN and inf are refused on the sending side** (:func:`compress` raises
ProtocolError naming how many blocks hold them): a block's scale cannot carry
them (one NaN would wipe its 63 neighbours), and an activation or gradient
that is not finite means the training has diverged, which the error then says
at the first boundary it reaches. The check is free: it reads the block maxima
the scales are made of.

Example::

    payload = encode(activation, "fp8")                      # uint8 (4 nb + n,): what goes on the link
    x = decode(payload, "fp8", torch.bfloat16, (4, 64, 512))  # the tensor, within the error above
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from geosched.compression import BLOCK, SCALE_BYTES, Codec, compressed_bytes
from geosched.errors import ProtocolError

QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
"""The largest magnitude of each codec's values: a block's largest maps to it."""
VALUE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
"""How each codec's value bytes read."""
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Tensors the codecs take (and give back)."""


def _check(codec: str, dtype: torch.dtype) -> None:
    if codec not in QMAX:
        raise ProtocolError(f"unknown codec {str(codec)[:20]!r}: one of {sorted(QMAX)} (or 'none': not compressed)")
    if dtype not in FLOAT_DTYPES:
        raise ProtocolError(f"{codec} compresses float32, bfloat16 and float16 tensors, not {dtype}")


def blocks_of(numel: int) -> int:
    """Blocks (so scales) of a tensor of ``numel`` values: ceil(numel / BLOCK)."""
    return -(-numel // BLOCK)


def payload_bytes(numel: int, dtype: torch.dtype, codec: Codec) -> int:
    """Bytes on the wire of a tensor of ``numel`` values of ``dtype``: ``geosched.compression.compressed_bytes``."""
    return compressed_bytes(numel * dtype.itemsize, dtype.itemsize, codec)


def compress(tensor: torch.Tensor, codec: Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (n,) int8 or float8_e4m3fn, scales (nb,) float32) of ``tensor``, on its device.

    ProtocolError if the tensor is not float32/bfloat16/float16 or holds NaN or inf.
    """
    payload = encode(tensor, codec)
    nb = blocks_of(tensor.numel())
    return payload[SCALE_BYTES * nb :].view(VALUE_DTYPES[codec]), payload[: SCALE_BYTES * nb].view(torch.float32)


def decompress(
    values: torch.Tensor, scales: torch.Tensor, codec: Codec, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` that :func:`compress` made ``(values, scales)`` of."""
    _check(codec, dtype)
    n, nb = math.prod(shape), blocks_of(math.prod(shape))
    got = (values.dtype, tuple(values.shape), scales.dtype, tuple(scales.shape))
    if got != (VALUE_DTYPES[codec], (n,), torch.float32, (nb,)):
        raise ProtocolError(
            f"{codec} of {n} values needs values {VALUE_DTYPES[codec]} ({n},) and scales float32 ({nb},), got "
            f"{values.dtype} {tuple(values.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )
    return _decompress(values, scales, dtype, shape)


def encode(tensor: torch.Tensor, codec: Codec) -> torch.Tensor:
    """The wire payload of ``tensor``: uint8 (4 nb + n,), the fp32 scales then the value bytes; on its device.

    ProtocolError if the tensor is not float32/bfloat16/float16 or holds NaN or inf (see the module's doc).
    """
    _check(codec, tensor.dtype)
    flat = tensor.detach().reshape(-1)  # (n,)
    n, nb = flat.numel(), blocks_of(flat.numel())
    x = flat.float()  # (n,) fp32 (the tensor itself if it is fp32)
    if n % BLOCK:
        x = torch.nn.functional.pad(x, (0, nb * BLOCK - n))  # zeros change no block's max
    blocks = x.view(nb, BLOCK)  # (nb, 64)
    amax = blocks.abs().amax(dim=1)  # (nb,) max |x| per block; NaN propagates, inf stays inf
    if nb and not math.isfinite(float(amax.max())):
        bad = int((~torch.isfinite(amax)).sum())
        raise ProtocolError(
            f"{bad} of {nb} blocks of {BLOCK} values hold NaN or inf: {codec} carries finite values only "
            f"(the training diverged: lower job.learning_rate, or send uncompressed with job.wan_compression: none)"
        )
    payload = torch.empty(SCALE_BYTES * nb + n, dtype=torch.uint8, device=tensor.device)
    scales = payload[: SCALE_BYTES * nb].view(torch.float32)  # (nb,)
    torch.div(amax, QMAX[codec], out=scales)
    divisor = torch.where(amax > 0, scales, torch.ones_like(scales))  # a zero block divides by 1: zeros
    q = blocks.div(divisor[:, None]).view(-1)[:n]  # (n,) in [-qmax, qmax]
    values = payload[SCALE_BYTES * nb :].view(VALUE_DTYPES[codec])  # (n,)
    if codec == "int8":
        q = q.round_().clamp_(-127, 127)  # exact small integers: the cast below is exact
    values.copy_(q)  # int8, or e4m3 rounded to nearest (|q| <= 448: never out of range)
    return payload


def decode(payload: torch.Tensor, codec: Codec, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` a received payload holds, on the payload's device.

    Everything is checked before the tensor is allocated; ProtocolError in one line for a payload that is
    not what this tensor's encoding would be (dtype, size, scale count) or whose scales are not finite, >= 0.
    """
    _check(codec, dtype)
    n = math.prod(shape)
    nb, expected = blocks_of(n), payload_bytes(n, dtype, codec)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
        raise ProtocolError(
            f"refused: a {codec} payload of {dtype} {list(shape)} is uint8 ({expected},) ({nb} scales + {n} values), "
            f"got {payload.dtype} {list(payload.shape)}"
        )
    payload = payload.contiguous()
    scales = payload[: SCALE_BYTES * nb].view(torch.float32)  # (nb,)
    if nb and not (float(scales.min()) >= 0 and math.isfinite(float(scales.max()))):  # NaN fails both
        raise ProtocolError(f"refused: a {codec} payload with scales that are not finite and >= 0")
    return _decompress(payload[SCALE_BYTES * nb :].view(VALUE_DTYPES[codec]), scales, dtype, shape)


@dataclass(frozen=True)
class TensorCodec:
    """How one link's tensors travel: ``codec`` applied to tensors of ``dtype`` and ``shape``, the only ones it
    carries (a stage boundary's); both ends hold the same one, so the receiver knows what to expect."""

    codec: Codec
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check(self.codec, self.dtype)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one tensor on the wire."""
        return payload_bytes(math.prod(self.shape), self.dtype, self.codec)

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """The payload of ``tensor``; ProtocolError if it is not of this dtype and shape, or not finite."""
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise ProtocolError(
                f"a {self.codec} link carries {self.dtype} {list(self.shape)} tensors, not {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
        return encode(tensor, self.codec)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The tensor a received payload holds; ProtocolError in one line if it is not one of this codec's."""
        return decode(payload, self.codec, self.dtype, self.shape)

    def buffer(self) -> torch.Tensor:
        """An empty payload to receive into (``WanLink.start_recv(out=...)``: another size is refused)."""
        return torch.empty(self.payload_bytes, dtype=torch.uint8)

    def describe(self) -> str:
        """E.g. ``fp8 float32 [2, 64, 64]``."""
        return f"{self.codec} {str(self.dtype).removeprefix('torch.')} {list(self.shape)}"


def _decompress(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """values (n,) x their block's scale, in fp32, into a new (shape) tensor of ``dtype``."""
    n = values.numel()
    full = n // BLOCK
    if values.dtype == torch.float8_e4m3fn:  # torch's e4m3 -> fp32 cast is scalar on CPU: widen the bits instead
        values, scales = _e4m3_as_fp16(values), scales * E4M3_IN_FP16
    out = torch.empty(n, dtype=dtype, device=values.device)  # (n,)
    if full:  # int8 or fp16 values x fp32 scales: the product in fp32, rounded once into dtype
        main = values[: full * BLOCK].view(full, BLOCK)  # (full, 64)
        torch.mul(main, scales[:full, None], out=out[: full * BLOCK].view(full, BLOCK))
    if n % BLOCK:  # the short last block
        torch.mul(values[full * BLOCK :], scales[full:], out=out[full * BLOCK :])  # (1,), not 0-d: fp32 math
    return out.view(tuple(shape))


E4M3_IN_FP16 = 2.0**8
"""An e4m3 byte shifted into an fp16's bits reads as its value x 2^-8 (exponent biases 7 and 15)."""
_SIGN_AND_LOW_14 = -16512  # 0xBF80 as int16: the sign bit and bits 13..7 (e4m3's exponent and mantissa)


def _e4m3_as_fp16(values: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values (n,) as float16 (n,) of value x 2^-8, exactly (normals and subnormals alike).

    An e4m3 byte ``s eeee mmm`` moved up 7 bits is the fp16 ``s 0eeee mmm0000000``: the same mantissa, the
    exponent 8 lower relative to fp16's bias. Sign-extending the byte to int16 and masking bit 14 gets
    there in three vectorised integer ops (the NaN bytes 0x7f and 0xff, which no sender makes, read 1.875 x 2^-8).
    """
    wide = values.view(torch.int8).to(torch.int16)  # (n,) sign-extended
    return ((wide << 7) & _SIGN_AND_LOW_14).view(torch.float16)
