"""WAN compression of activations and activation gradients: the formats and what they cost, torch-free.

A message crossing a WAN link may travel compressed: its values in blocks of
:data:`BLOCK` consecutive elements, each block one fp32 scale (its largest
magnitude over the format's largest value) and one byte per value, either
``int8`` (``round(x / scale)``, scale = max|x| / 127) or ``fp8`` (e4m3,
scale = max|x| / 448; the format of FP8-LM, Peng et al. 2023, and of
DeepSpeed's and torchao's fp8 communication). At bf16 that is
``(64 + 4) / 128 = 0.53`` of the bytes (fp32: 0.27); the error is at most half a
step of the format per value, relative to its block's largest (int8: 1/254;
e4m3: 1/16 of the value itself, whose 3 mantissa bits keep small values
relative). Blocks of 64 rather than 128: a block's scale follows its own
largest value more closely, which on the demo's boundary tensors takes 8-20 %
off int8's error (5-17 % off the weight gradients' error it causes) for 3 %
more bytes; 32 would be 0.56 of bf16's bytes, past the 0.55 the compression
was asked to stay under (``benchmarks/compression.py``).

Compression is lossy, so the job opts in (``job.wan_compression``); then each
WAN link is compressed where that shortens the message: the link time it saves,
``(bytes - compressed bytes) x 8 / rate``, beats the codec time it adds, a few
passes over the tensor at memory speed (:func:`codec_s`; measured by a
calibration on the machine that runs it). :class:`~geosched.pipeline_costs.PipelineCosts`
decides per link and the plan file records it; ``agents.wan.compress`` is the
torch codec the agents run.
"""

from __future__ import annotations

from typing import Literal

Codec = Literal["none", "int8", "fp8"]
CODECS: tuple[Codec, ...] = ("none", "int8", "fp8")
BLOCK = 64
"""Values per scale."""
SCALE_BYTES = 4
"""One fp32 scale per block."""
CODEC_PASSES = 4
"""Memory passes one compress + decompress makes over the tensor (read, write the bytes and scales; read them,
write the values), what an uncalibrated codec time is priced at."""
ASSUMED_CODEC_BANDWIDTH_BPS = 2.0e12
"""Device memory bandwidth (bytes/s) for the codec without a calibration: an A100 80GB's HBM2e (as the
cost model's optimizer step)."""


def compressed_bytes(nbytes: int, element_bytes: int, codec: Codec) -> int:
    """Bytes on the wire for a tensor of ``nbytes`` at ``element_bytes`` per value under ``codec``."""
    if codec == "none":
        return nbytes
    values = -(-nbytes // element_bytes)
    blocks = -(-values // BLOCK)
    return values + blocks * SCALE_BYTES


def wire_ratio(element_bytes: int, codec: Codec) -> float:
    """Wire bytes over tensor bytes under ``codec``, for a tensor of whole blocks (1.0 for none)."""
    return compressed_bytes(BLOCK * element_bytes, element_bytes, codec) / (BLOCK * element_bytes)


def codec_s(nbytes: int, seconds_per_byte: float | None = None) -> float:
    """Seconds to compress and decompress a tensor of ``nbytes``: ``seconds_per_byte`` measured, else
    :data:`CODEC_PASSES` passes at :data:`ASSUMED_CODEC_BANDWIDTH_BPS`."""
    per_byte = CODEC_PASSES / ASSUMED_CODEC_BANDWIDTH_BPS if seconds_per_byte is None else seconds_per_byte
    return nbytes * per_byte


def worth_it(saved_s: float, codec_time_s: float) -> bool:
    """True when compressing a message saves more link time than the codec costs."""
    return saved_s > codec_time_s
