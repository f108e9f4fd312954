"""The WAN codec (agents.wan.compress): the format exactly as geosched.compression states it, its error
bounds, zeros and short blocks, NaN/inf refused on the way out, hostile payloads refused on the way in."""

from __future__ import annotations

import pytest
import torch

from agents.wan.compress import (
    QMAX,
    TensorCodec,
    blocks_of,
    compress,
    decode,
    decompress,
    encode,
    payload_bytes,
)
from geosched.compression import BLOCK, compressed_bytes
from geosched.errors import ProtocolError

CODECS = ("int8", "fp8")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUTPUT_ROUNDING = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""Relative rounding of the decoded value into each dtype (fp32: a little over its unit, for the fp32 arithmetic)."""
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def sample(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Values over nine decades (blocks of very different scales), a few exact zeros, in ``dtype``."""
    g = torch.Generator().manual_seed(7)
    n = torch.Size(shape).numel()
    x = torch.randn(n, generator=g) * torch.logspace(-4, 4, n)[torch.randperm(n, generator=g)]
    x[:: max(1, n // 7)] = 0.0
    return x.reshape(shape).to(dtype=dtype, device=device)


def per_value_scale(payload: torch.Tensor, n: int) -> torch.Tensor:
    """Each value's block scale, read from a payload: (n,) fp32."""
    nb = blocks_of(n)
    return payload[: 4 * nb].view(torch.float32).repeat_interleave(BLOCK)[:n]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_error_is_within_the_stated_bound(codec: str, dtype: torch.dtype, device: str) -> None:
    """int8: <= scale/2 per value; fp8 e4m3: <= 2^-4 of the value where it is a normal e4m3 number (|x|/scale
    >= 2^-6), <= 2^-10 scale below; plus the decoded value's rounding into the tensor's dtype."""
    x = sample((3, 5, 67), dtype, device)  # 1005 values: 15 full blocks and a short one of 45
    payload = encode(x, codec)
    assert payload.dtype == torch.uint8 and payload.device == x.device
    assert payload.numel() == compressed_bytes(x.numel() * x.element_size(), x.element_size(), codec) == 4 * 16 + 1005
    y = decode(payload, codec, dtype, x.shape)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    exact, got = x.double().reshape(-1).cpu(), y.double().reshape(-1).cpu()
    scale = per_value_scale(payload.cpu(), x.numel()).double()
    err = (got - exact).abs()
    rounding = OUTPUT_ROUNDING[dtype] * got.abs() + (2.0**-24 if dtype == torch.float16 else 0.0)  # fp16 subnormals
    if codec == "int8":
        bound = scale / 2 * (1 + 2**-20)
    else:
        normal = exact.abs() >= scale * 2.0**-6
        bound = torch.where(normal, exact.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2**-20)
    assert bool((err <= bound + rounding).all()), float(((err - bound - rounding) / scale.clamp_min(1e-30)).max())
    assert bool((got[exact == 0] == 0).all())


@pytest.mark.parametrize("codec", CODECS)
def test_the_payload_is_the_format_block_by_block(codec: str) -> None:
    """Against a plain loop over blocks: scales max|x|/qmax first, then one byte a value; a short last block."""
    x = sample((300,), torch.float32)  # 4 blocks of 64 and one of 44
    values, scales = compress(x, codec)
    flat = x.reshape(-1)
    for b in range(blocks_of(x.numel())):
        block = flat[b * BLOCK : (b + 1) * BLOCK]
        scale = block.abs().max() / QMAX[codec]
        assert scales[b] == scale
        quantized = block / scale if scale > 0 else torch.zeros_like(block)
        if codec == "int8":
            assert torch.equal(values[b * BLOCK : (b + 1) * BLOCK], quantized.round().clamp(-127, 127).to(torch.int8))
        else:
            assert torch.equal(values[b * BLOCK : (b + 1) * BLOCK].float(), quantized.to(torch.float8_e4m3fn).float())
    whole = decompress(values, scales, codec, torch.float32, x.shape)
    assert torch.equal(whole, decode(encode(x, codec), codec, torch.float32, x.shape))
    by_block = (values.float() * scales.repeat_interleave(BLOCK)[: x.numel()]).reshape(x.shape)
    assert torch.equal(whole, by_block)  # the fp8 bit trick of the decoder is exact


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000])
def test_zeros_and_every_block_length(codec: str, n: int) -> None:
    zeros = torch.zeros(n, dtype=torch.bfloat16)
    payload = encode(zeros, codec)
    assert payload.numel() == payload_bytes(n, torch.bfloat16, codec) == 4 * -(-n // BLOCK) + n
    assert bool((payload == 0).all())  # scale 0, values 0
    assert torch.equal(decode(payload, codec, torch.bfloat16, (n,)), zeros)
    mixed = torch.rand(n) + 1.0
    mixed[:BLOCK] = 0.0  # a zero block among others: scale 0, zeros back; the others untouched by it
    payload = encode(mixed, codec)
    back = decode(payload, codec, torch.float32, (n,))
    assert payload[:4].view(torch.float32).tolist() == ([0.0] if n else [])
    assert bool((back[:BLOCK] == 0).all()) and bool((back[BLOCK:] != 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_on_the_way_out(bad: float) -> None:
    x = torch.randn(1000)
    x[5], x[900] = bad, bad
    with pytest.raises(ProtocolError, match=r"2 of 16 blocks of 64 values hold NaN or inf: fp8 carries finite"):
        encode(x, "fp8")


def test_hostile_or_mismatched_payloads_are_refused_in_one_line() -> None:
    codec = TensorCodec("fp8", torch.float32, (2, 64, 64))
    assert codec.payload_bytes == 4 * 128 + 8192 and codec.describe() == "fp8 float32 [2, 64, 64]"
    good = codec.encode(torch.randn(2, 64, 64))
    assert codec.decode(good).shape == (2, 64, 64)
    cases = {
        "short": good[:-1],
        "long": torch.cat([good, good[:1]]),
        "dtype": good.view(torch.int8),
        "2-d": good.view(2, -1),
    }
    for name, payload in cases.items():
        with pytest.raises(ProtocolError, match=r"^refused: a fp8 payload of torch.float32 \[2, 64, 64\]") as err:
            codec.decode(payload)
        assert "\n" not in str(err.value), name
    for scale in (float("nan"), float("inf"), -1.0):
        hostile = good.clone()
        hostile[4:8].view(torch.float32)[0] = scale  # the second block's scale
        with pytest.raises(ProtocolError, match="scales that are not finite and >= 0"):
            codec.decode(hostile)
    with pytest.raises(
        ProtocolError, match=r"carries torch.float32 \[2, 64, 64\] tensors, not torch.float32 \[2, 64\]"
    ):
        codec.encode(torch.randn(2, 64))
    with pytest.raises(ProtocolError, match="not torch.int64"):
        TensorCodec("int8", torch.int64, (4,))
    with pytest.raises(ProtocolError, match="unknown codec 'zstd'"):
        encode(torch.randn(4), "zstd")  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", CODECS)
def test_the_price_is_one_byte_a_value_and_one_scale_a_block(codec: str) -> None:
    """What the planner prices (torch-free) is what the codec sends: at bf16 (BLOCK + 4) / (2 BLOCK) of the
    bytes, 0.53 with blocks of 64, under the 0.55 asked of the compression; at fp32 half that."""
    n = 1000 * BLOCK + 1  # a short last block of one value
    for dtype, ratio in ((torch.bfloat16, 0.53125), (torch.float32, 0.265625)):
        nbytes = n * dtype.itemsize
        wire = compressed_bytes(nbytes, dtype.itemsize, codec)
        assert wire == payload_bytes(n, dtype, codec) == n + 4 * (1000 + 1)
        assert wire / nbytes == pytest.approx(ratio, abs=1e-3) and wire / nbytes <= 0.55
    assert compressed_bytes(123, 2, "none") == 123
