"""What the WAN codec costs here: ``codec_s_per_byte`` of a calibration (:mod:`geosched.compression`).

The cost model adds ``codec_s(nbytes, codec_s_per_byte)`` to every compressed
boundary message (``nbytes``: the whole boundary tensor). :func:`measure_codec`
times what the agents do with one message of the job: encode one rank's
boundary tensor (microbatch x seq_len x hidden / tp at the job's precision;
with tensor parallelism each tp rank codes its own slice, in parallel with the
others) on ``device``, bring the payload to the CPU as the link does, and
decode it there as the receiving transport does. The median over ``repeats``,
divided by the bytes of the whole boundary tensor, is the figure. The tensor is
small, so on a CPU the figure is mostly the codec's fixed cost per message.

    cal.update(measure_codec(job))   # {"codec_s_per_byte": 2.1e-09}; None when job.wan_compression is none
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from agents.wan.compress import TensorCodec
from geosched.compression import Codec
from geosched.config import JobSpec
from geosched.model import PRECISION_DTYPES


def measure_codec(
    job: JobSpec, *, codec: Codec | None = None, device: str = "cpu", repeats: int = 30, warmup: int = 5
) -> dict[str, Any]:
    """``{"codec_s_per_byte": seconds}`` of ``codec`` (default: the job's ``wan_compression``; None for none)."""
    codec = codec or job.wan_compression
    if codec == "none":
        return {"codec_s_per_byte": None}
    dtype = PRECISION_DTYPES[job.precision]
    shape = (job.batch, job.model.seq_len, job.model.hidden // job.tp)  # one tp rank's slice
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    link = TensorCodec(codec, dtype, shape)
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        link.decode(link.encode(tensor).cpu())
        if i >= warmup:
            times.append(time.perf_counter() - start)
    whole = job.batch * job.model.seq_len * job.model.hidden * dtype.itemsize
    return {"codec_s_per_byte": statistics.median(times) / whole}
