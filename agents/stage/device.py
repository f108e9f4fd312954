"""The device a rank trains on: the CPU or one GPU of its host, from ``--device``, checked before anything starts.

A rank's stage (weights, gradients, optimizer state, activations) lives on its
device. The WanLinks move host memory, so :class:`~agents.stage.transport.LinkTransport`
brings a boundary tensor to the host as it leaves (compressed on the device
first where the plan compresses the link: fewer bytes cross PCIe too) and onto
the device as it arrives; a cross-DC gradient sync stages its lanes in host
memory the same way (:mod:`agents.crossdc.sync`). Collectives inside a DC run
over NCCL on GPUs and gloo on the CPU (:func:`group_backend`).

``--device cuda`` picks GPU ``rank % visible GPUs`` (ranks numbered host by
host, as ``geosched launch`` starts them); ``cuda:N`` names one. NCCL needs
one GPU per rank of a group: ranks that would share one in a data-parallel or
tensor-parallel group are refused in one line when the group forms
(:class:`agents.dp.group.DataParallelGroup`), and :func:`device_refusal` refuses,
before the agent connects, a tensor-parallel degree larger than the host's GPUs
and a stage larger than its GPU's memory (as the plan's memory model counts it).

    device = rank_device("cuda", rank=3)          # cuda:3 on an 8-GPU host, cuda:1 on a 2-GPU one
    refusal = device_refusal(layout, role, device)  # None, or the one line to exit 2 with
    refusal = host_refusal(layout, "cuda")          # every rank on this host (geosched launch)
"""

from __future__ import annotations

import re

import torch

from agents.layout import JobLayout, RankRole
from agents.stage.schedule import predicted_stage_bytes
from geosched.errors import InputError, PlanError

DEVICE_CHOICES = "cpu, cuda (GPU rank % GPUs) or cuda:N"
GIB = 2**30
_PATTERN = re.compile(r"cpu|cuda(:\d{1,3})?")


def check_device_text(text: str, flag: str = "--device") -> str:
    """``text`` if it names a device this module knows (``cpu``, ``cuda``, ``cuda:N``); InputError otherwise."""
    if not isinstance(text, str) or not _PATTERN.fullmatch(text):
        raise InputError(f"{flag} {text!r}: expected {DEVICE_CHOICES}")
    return text


def rank_device(text: str, rank: int, flag: str = "--device") -> torch.device:
    """The device rank ``rank`` trains on for ``--device text``; InputError (one line) if this host lacks it."""
    check_device_text(text, flag)
    if text == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InputError(
            f"{flag} {text}: this torch ({torch.__version__}) sees no GPU; install a CUDA build of torch "
            f"on a GPU host, or train on the CPU ({flag} cpu)"
        )
    count = torch.cuda.device_count()
    index = rank % count if text == "cuda" else int(text.split(":")[1])
    if index >= count:
        raise InputError(f"{flag} {text}: this host has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def group_backend(device: torch.device) -> str:
    """The torch.distributed backend of a group whose ranks train on ``device``: NCCL on GPUs, gloo on CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def device_refusal(layout: JobLayout, role: RankRole, device: torch.device) -> str | None:
    """Why this rank cannot run its part of the plan on ``device``, or None: more tensor-parallel GPUs than the
    host has, or a stage the GPU's memory cannot hold (:func:`memory_refusal`)."""
    if device.type != "cuda":
        return None
    count = torch.cuda.device_count()
    if role.tp_size > count:
        return (
            f"its stage is sharded over tensor_parallel {role.tp_size} GPUs of one node, but this host has "
            f"{count}; re-plan with 'geosched plan CONFIG --tp {count}' or train on the CPU (--device cpu)"
        )
    return memory_refusal(layout, role, torch.cuda.get_device_properties(device).total_memory, str(device))


def memory_refusal(layout: JobLayout, role: RankRole, capacity_bytes: int, where: str) -> str | None:
    """Why the device ``where`` of ``capacity_bytes`` cannot hold ``role``'s stage as the plan's memory model
    counts it (:func:`~agents.stage.schedule.predicted_stage_bytes`), or None."""
    need = predicted_stage_bytes(layout, role)
    if need <= capacity_bytes:
        return None
    job = layout.job
    return (
        f"its stage needs {need / GIB:.3g} GiB (layers {role.layers[0]}-{role.layers[1] - 1}: weights, gradients and "
        f"optimizer state at ZeRO {job.zero_stage}, activations in flight, recompute {job.recompute}) but {where} "
        f"has {capacity_bytes / GIB:.3g} GiB; re-plan with this GPU's memory as the config's gpu.memory_gib"
    )


def check_device_fits(layout: JobLayout, role: RankRole, text: str) -> None:
    """PlanError (one line) if rank ``role.rank`` cannot run its part on ``--device text`` (an agent at start)."""
    refusal = device_refusal(layout, role, rank_device(text, role.rank))
    if refusal is not None:
        raise PlanError(f"rank {role.rank}: {refusal}")


def host_refusal(layout: JobLayout, text: str) -> str | None:
    """Why the ranks of ``layout`` cannot all train on this one host with ``--device text`` (``geosched launch``),
    or None: a rank's own refusal, or two ranks of one group on one GPU (NCCL needs one GPU per rank)."""
    if text == "cpu":
        return None
    first: dict[tuple[str, torch.device], RankRole] = {}
    for role in layout.roles:
        device = rank_device(text, role.rank)
        refusal = device_refusal(layout, role, device)
        if refusal is not None:
            return f"rank {role.rank}: {refusal}"
        other = first.setdefault((role.group, device), role)
        if other is not role and role.group_size > 1:
            return (
                f"ranks {other.rank} and {role.rank} of group {role.group!r} would share GPU {device} of this host's "
                f"{torch.cuda.device_count()}, and NCCL needs one GPU per rank; re-plan with fewer ranks per stage "
                "(geosched plan CONFIG --tp 1 --dp 1) or rehearse on the CPU (--device cpu)"
            )
    return None
