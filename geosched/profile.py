"""Measure the job's model on this machine: per-layer forward/backward time and activation sizes.

``geosched profile`` runs real torch on the pieces the cost model prices
separately, each built by :func:`geosched.model.build_stage` with the job's
shape, precision and microbatch size:

- the embeddings alone (a first stage of no blocks): tokens (b, T) -> (b, T, C);
- one transformer block (a middle stage of one layer): (b, T, C) -> (b, T, C);
- the final norm, head and loss (a last stage of no blocks): (b, T, C) -> scalar.

Each piece runs ``warmup`` untimed iterations, then ``repeats`` timed ones,
each as a training step runs it (the forwards of up to 8 microbatches
stashing activations, then their backwards); the median forward and
backward times, divided by the microbatch size, are
the per-sequence times of :class:`geosched.costmodel.Calibration`, and
``tflops`` is the throughput the block measurement implies
(``gpt_block_cost(job).forward_flop / block_forward_s``). The optimizer step
is timed on a first stage of up to two blocks (AdamW with the job's learning
rate, then ``zero_grad(set_to_none=False)``, as the stage runtime's STEP does)
and divided by its parameter count: ``optimizer_step_s_per_param``. Activation sizes
(what a block sends on, what it stashes for backward) are measured from the
tensors autograd actually saves.

Given the ``stages`` of a plan (layer range, first, last), each is also
measured whole, the same way, into ``stage_times``: the cost model then uses
those instead of adding up the pieces (a stage's working set is larger than
any piece's, which a CPU's caches notice).

Example::

    cal = profile_job(load_config("configs/demo-3dc.yaml").job, repeats=7)
    write_calibration(cal, "calibration.json")
    check = check_prediction(job, Calibration.load("calibration.json"))   # 2-layer stage: measured vs predicted
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from geosched.config import JobSpec
from geosched.costmodel import Calibration, gpt_block_cost, stage_compute
from geosched.errors import InputError
from geosched.model import PRECISION_DTYPES, ModelShape, build_stage
from geosched.optim import TIMING_LR, MasterAdamW, gradient_dtype, set_gradient_dtype
from geosched.wgrad import SplitBackward
from geosched.yamlload import write_atomically

MAX_PROFILE_MICROBATCHES = 8
"""Microbatches a measured step keeps in flight at most (1F1B holds at most p per stage)."""

Progress = Callable[[int, int, str], None]
"""``progress(done, total, label)``: called after every timed or warm-up iteration."""


@dataclass(frozen=True)
class StageTiming:
    """Median seconds of one microbatch through a stage, the spread of the samples and their means."""

    forward_s: float
    backward_s: float
    forward_spread_s: float  # max - min over the timed repeats
    backward_spread_s: float
    forward_mean_s: float  # what a step's many forwards add up to, preemptions on a shared host included
    backward_mean_s: float
    input_backward_mean_s: float | None = None  # ``split_backward``: the zero-bubble I and W passes (means)
    weight_backward_mean_s: float | None = None


def measure_stage(
    job: JobSpec,
    layers: tuple[int, int],
    *,
    first: bool,
    last: bool,
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
    microbatches: int = 1,
    module: torch.nn.Module | None = None,
    split_backward: bool = False,
) -> StageTiming:
    """Time forward and backward of one microbatch through the stage holding ``layers`` (+ embeddings/head).

    Each repeat runs as a training step does: the forwards of ``microbatches``
    microbatches, each stashing its activations (autograd on), then their
    backwards; every forward and backward is a sample. The last stage's
    forward includes the loss. Gradients accumulate as they do across
    microbatches. Several microbatches in flight matter on a CPU: the stash
    and the weights no longer fit the caches, which a one-microbatch loop hides.
    ``module``: the stage to time (e.g. one sharded over tensor-parallel ranks) instead of a fresh one.
    ``split_backward`` (a stage that is not the first): every other backward runs as the zero-bubble
    schedule's I then W passes (:class:`geosched.wgrad.SplitBackward`, as the stage runtime runs them),
    each timed; the fused backwards are the others.
    """
    if repeats < 1 or warmup < 0:
        raise InputError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    stage: Any = module
    if stage is None:
        dtype = PRECISION_DTYPES[job.precision]
        stage = build_stage(job.model, *layers, first=first, last=last, seed=job.seed, dtype=dtype).to(device)
    set_gradient_dtype(stage.parameters(), job.grad_dtype)  # the backward accumulates as the stage's does
    shape = ModelShape.of(job.model)
    b, T = job.batch, shape.seq_len
    g = torch.Generator().manual_seed(job.seed)

    def make_input() -> torch.Tensor:
        if first:
            return torch.randint(0, shape.vocab, (b, T), generator=g).to(device)  # (b, T)
        x = torch.randn(b, T, shape.hidden, generator=g).to(device, PRECISION_DTYPES[job.precision])  # (b, T, C)
        return x.requires_grad_(True)

    inputs = [make_input() for _ in range(max(1, microbatches))]  # distinct, as microbatches are
    targets = torch.randint(0, shape.vocab, (b, T), generator=g).to(device)  # (b, T)
    out_grad = None
    split = SplitBackward(stage) if split_backward and not first else None
    forward, backward, input_backward, weight_backward = [], [], [], []
    for i in range(warmup + repeats):
        outs = []
        # which microbatches split their backward this repeat: every other one, alternating across repeats
        splits = [split is not None and (i * len(inputs) + k) % 2 == 1 for k in range(len(inputs))]
        for k, xi in enumerate(inputs):
            if not first:
                xi.grad = None
            if split is not None:
                split.defer(splits[k])
            _sync(device)
            t0 = time.perf_counter()
            out = stage(xi)  # (b, T, C) or logits (b, T, V)
            if last:
                out = stage.loss(out, targets)  # scalar
            _sync(device)
            if i >= warmup:
                forward.append(time.perf_counter() - t0)
            outs.append(out)
        for k, (xi, out) in enumerate(zip(inputs, outs)):
            if out_grad is None and not last:
                out_grad = torch.randn(out.shape, generator=g).to(device, out.dtype)  # like the next stage's
            _sync(device)
            t1 = time.perf_counter()
            if split is not None and splits[k]:
                grads = None if out_grad is None else [out_grad]  # None: the loss, a scalar
                _, work = split.input([out], grads, xi)
                _sync(device)
                t2 = time.perf_counter()
                split.weight(work)
                _sync(device)
                if i >= warmup:
                    input_backward.append(t2 - t1)
                    weight_backward.append(time.perf_counter() - t2)
                continue
            out.backward() if last else out.backward(out_grad)
            _sync(device)
            if i >= warmup:
                backward.append(time.perf_counter() - t1)
        if progress is not None:
            progress("warm-up" if i < warmup else "timed")
    return StageTiming(
        statistics.median(forward),
        statistics.median(backward),
        max(forward) - min(forward),
        max(backward) - min(backward),
        statistics.fmean(forward),
        statistics.fmean(backward),
        statistics.fmean(input_backward) if input_backward else None,
        statistics.fmean(weight_backward) if weight_backward else None,
    )


SPLIT_PAIRS = 15
"""The fewest samples of each backward kind :func:`measure_backward_split` takes (cheap: one block)."""


def measure_backward_split(job: JobSpec, *, repeats: int = 5, warmup: int = 2, device: str = "cpu") -> float:
    """(I + W) / B on one block: the input-gradient and weight-gradient passes the zero-bubble schedule runs
    (:class:`geosched.wgrad.SplitBackward`, as the stage runtime does) against one fused backward. The same
    FLOPs (Qi et al. 2023); what is left is the deferred layers' bookkeeping, about 1.05 on the demo's blocks
    on a CPU (torch's ``stage_backward_input`` and ``stage_backward_weight``, which walk the graph twice,
    cost about 2.0).

    The fastest of at least :data:`SPLIT_PAIRS` alternated samples of each, divided: the ratio is the compute's,
    and a block's passes are short enough (well under a millisecond on the demo) that a host shared with
    other ranks preempts some of either kind. On a 2-core host shared by three processes, the median of
    per-pair ratios read 2.0 to 6.5 (it was 2.1 alone); this reads 1.7 to 2.9, most of it 1.9 to 2.4 (both
    with torch's two-pass split, before the deferred layers).
    """
    dtype = PRECISION_DTYPES[job.precision]
    stage = build_stage(job.model, 0, 1, first=False, last=False, seed=job.seed, dtype=dtype).to(device)
    split = SplitBackward(stage)
    shape = ModelShape.of(job.model)
    g = torch.Generator().manual_seed(job.seed)
    x0 = torch.randn(job.batch, shape.seq_len, shape.hidden, generator=g).to(device, dtype)  # (b, T, C)
    grad = torch.randn(x0.shape, generator=g).to(device, dtype)
    fused_s, split_s = [], []
    for i in range(warmup + max(repeats, SPLIT_PAIRS)):
        x = x0.clone().requires_grad_(True)
        split.defer(False)
        out = stage(x)
        _sync(device)
        t0 = time.perf_counter()
        out.backward(grad)
        _sync(device)
        fused = time.perf_counter() - t0
        x = x0.clone().requires_grad_(True)
        split.defer(True)
        out = stage(x)
        _sync(device)
        t0 = time.perf_counter()
        _, work = split.input([out], [grad], x)
        split.weight(work)
        _sync(device)
        if i >= warmup:
            fused_s.append(fused)
            split_s.append(time.perf_counter() - t0)
        stage.zero_grad(set_to_none=True)
    return min(split_s) / min(fused_s)


def measure_optimizer_step(
    job: JobSpec,
    *,
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
    microbatches: int = 1,
) -> float:
    """Median seconds per parameter of one AdamW step plus zeroing the gradients.

    Measured on a first stage (embeddings + up to two blocks: big and small
    tensors, bounded memory even for a large model). Gradients are random (the
    step's cost does not depend on their values); the optimizer state exists
    from the first warm-up step on, as in training. With ``microbatches`` > 1,
    each step follows that many forwards and backwards (untimed), as in
    training, so the weights and state are as cold as they are then.
    """
    if repeats < 1 or warmup < 0:
        raise InputError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    model = build_stage(
        job.model,
        0,
        min(2, job.model.layers),
        first=True,
        last=False,
        seed=job.seed,
        dtype=PRECISION_DTYPES[job.precision],
    ).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    set_gradient_dtype(params, job.grad_dtype)
    g = torch.Generator().manual_seed(job.seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device, gradient_dtype(p))
    optimizer = MasterAdamW(params, lr=TIMING_LR)
    tokens = torch.randint(0, ModelShape.of(job.model).vocab, (job.batch, job.model.seq_len), generator=g).to(
        device
    )  # (b, T)
    times = []
    for i in range(warmup + repeats):
        if microbatches > 1:
            for _ in range(microbatches):
                model(tokens).float().square().mean().backward()
        _sync(device)
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if progress is not None:
            progress("warm-up" if i < warmup else "timed")
    return statistics.median(times) / sum(p.numel() for p in params)


def profile_microbatches(job: JobSpec) -> int:
    """Microbatches in flight per measured step: the job's per-replica count, at most MAX_PROFILE_MICROBATCHES."""
    return max(1, min(MAX_PROFILE_MICROBATCHES, job.global_batch // job.batch))


def measure_activation_bytes(job: JobSpec, device: str = "cpu") -> dict[str, int]:
    """Bytes per sequence a block sends on, and what a block and the head stash for backward.

    The stash is the sum of the distinct storages autograd saves during one
    forward, weights excluded.
    """
    shape = ModelShape.of(job.model)
    b, T, dtype = job.batch, shape.seq_len, PRECISION_DTYPES[job.precision]
    sizes = {}
    for name, layers, last in (("block", (0, 1), False), ("head", (shape.layers, shape.layers), True)):
        stage = build_stage(job.model, *layers, first=False, last=last, seed=job.seed, dtype=dtype).to(device)
        weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        x = torch.randn(b, T, shape.hidden, device=device, dtype=dtype, requires_grad=True)  # (b, T, C)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = stage(x)  # (b, T, C) or (b, T, V)
            if last:
                out = stage.loss(out, torch.zeros(b, T, dtype=torch.int64, device=device))
        sizes[f"{name}_stash_bytes_per_sequence"] = sum(saved.values()) // b
        if not last:
            sizes["activation_bytes_per_sequence"] = out.numel() * out.element_size() // b
    return sizes


StageKey = tuple[tuple[int, int], bool, bool]
"""A plan's stage as the profiler measures it: ``((start, end), first, last)``."""


def profile_job(
    job: JobSpec,
    *,
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    gpu_name: str | None = None,
    progress: Progress | None = None,
    stages: Sequence[StageKey] = (),
) -> dict[str, Any]:
    """Measure the embeddings, one block and the head; return the calibration as a JSON-ready dict.

    The dict holds every :class:`~geosched.costmodel.Calibration` field (times
    per sequence) plus activation sizes and where and how it was measured;
    with ``stages``, also each of those whole stages (``stage_times``).
    """
    shape = ModelShape.of(job.model)
    stash = profile_microbatches(job)
    pieces = {
        "embed": ((0, 0), True, False),
        "block": ((0, 1), False, False),
        "head": ((shape.layers, shape.layers), False, True),
    }
    whole = list(dict.fromkeys(((start, end), bool(first), bool(last)) for (start, end), first, last in stages))
    for (start, end), _, _ in whole:
        if not 0 <= start <= end <= shape.layers:
            raise InputError(f"stage layers [{start}, {end}) are outside the model's {shape.layers} layers")
    pieces.update({stage_label(key): key for key in whole})
    total, done = (len(pieces) + 1) * (warmup + repeats), 0
    times: dict[str, StageTiming] = {}
    for name, (layers, first, last) in pieces.items():

        def tick(phase: str, name: str = name) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total, f"{name} {phase}")

        times[name] = measure_stage(
            job,
            layers,
            first=first,
            last=last,
            repeats=repeats,
            warmup=warmup,
            device=device,
            progress=tick,
            microbatches=stash,
        )

    def tick_step(phase: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, f"optimizer step {phase}")

    step_per_param = measure_optimizer_step(
        job, repeats=repeats, warmup=warmup, device=device, progress=tick_step, microbatches=stash
    )
    b = job.batch
    cal: dict[str, Any] = {"gpu_name": gpu_name or device_name(device)}
    for name in ("embed", "block", "head"):
        cal[f"{name}_forward_s"] = times[name].forward_s / b
        cal[f"{name}_backward_s"] = times[name].backward_s / b
    cal["stage_times"] = []
    for key in whole:
        timing = times[stage_label(key)]
        cal["stage_times"].append(stage_time_record(key, timing.forward_s / b, timing.backward_s / b))
    cal["tflops"] = gpt_block_cost(job).forward_flop / cal["block_forward_s"] / 1e12
    cal["backward_split"] = measure_backward_split(job, repeats=repeats, warmup=warmup, device=device)
    cal["optimizer_step_s_per_param"] = step_per_param
    cal.update(measure_activation_bytes(job, device))
    cal["spread_s"] = {
        f"{name}_{d}": getattr(t, f"{d}_spread_s") / b for name, t in times.items() for d in ("forward", "backward")
    }
    cal.update(
        {
            "model": {
                "layers": shape.layers,
                "hidden": shape.hidden,
                "heads": shape.heads,
                "seq_len": shape.seq_len,
                "vocab": shape.vocab,
                "ffn_mult": shape.ffn_mult,
            },
            "microbatch_size": b,
            "microbatches_in_flight": stash,
            "precision": job.precision,
            "device": device,
            "repeats": repeats,
            "warmup": warmup,
            "threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
            "host": socket.gethostname(),
            "created_at": time.time(),
        }
    )
    Calibration.from_dict(cal)  # the loader's fields are all there
    return cal


def stage_time_record(key: StageKey, forward_s: float, backward_s: float) -> dict[str, Any]:
    """One ``stage_times`` entry of a calibration dict (seconds per sequence), as ``StageTime`` reads it."""
    (start, end), first, last = key
    return {"start": start, "end": end, "first": first, "last": last, "forward_s": forward_s, "backward_s": backward_s}


def stage_label(key: StageKey) -> str:
    """How reports name a measured stage: ``stage 0-2 +embed``."""
    (start, end), first, last = key
    return f"stage {start}-{end}" + " +embed" * first + " +head" * last


class PredictionCheck(TypedDict):
    """What :func:`check_prediction` returns (a calibration file's ``check`` entry)."""

    layers: list[int]
    measured_s: float
    predicted_s: float
    predicted_over_measured: float  # predicted / measured


def check_prediction(
    job: JobSpec,
    calibration: Calibration,
    layers: tuple[int, int] = (0, 2),
    *,
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
) -> PredictionCheck:
    """Measure a middle stage of ``layers`` and compare with ``stage_compute`` using ``calibration``.

    Returns measured and predicted forward+backward seconds per microbatch and
    their ratio (predicted / measured).
    """
    measured = measure_stage(job, layers, first=False, last=False, repeats=repeats, warmup=warmup, device=device)
    predicted = stage_compute(job, calibration.tflops, layers, False, False, calibration)
    m = measured.forward_s + measured.backward_s
    p = predicted.forward_s + predicted.backward_s
    return {"layers": list(layers), "measured_s": m, "predicted_s": p, "predicted_over_measured": p / m}


def write_calibration(cal: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write the calibration JSON (via a temporary file and rename); return the path."""
    path = os.fspath(path)
    try:
        write_atomically(path, json.dumps(cal, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        raise InputError(f"cannot write calibration {path!r}: {exc.strerror or exc}; pick a writable -o path") from None
    return path


def device_name(device: str) -> str:
    """A readable name of the device measured: the CUDA device name, or the CPU model and thread count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu {model} x{torch.get_num_threads()} threads"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))
