"""(b) of pipeline.py, torch's side: the same stages trained by ``torch.distributed.pipelining`` over gloo."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from common import collect, cpu_for, free_port, pin_one_thread

from geosched.config import JobSpec


def _cross_entropy(logits: Any, targets: Any) -> Any:
    """The last stage's loss (as ``StageModule.loss``): mean cross-entropy of (b, T, V) logits."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _torch_rank(rank: int, job: JobSpec, layers: list[tuple[int, int]], port: int, steps: int, results: Any) -> None:
    """One stage trained by torch.distributed.pipelining over gloo: ``Schedule1F1B``, or for ``job.schedule``
    zb1p ``ScheduleInterleavedZeroBubble`` with one stage a rank (ZB-H1, the order geosched's zb1p runs)."""
    try:
        pin_one_thread(cpu_for(rank))
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble

        from geosched.data import TextDataset, default_corpus_paths
        from geosched.model import build_stage

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
        )
        start, end = layers[rank]
        module = build_stage(job.model, start, end, first=rank == 0, last=rank == 1, seed=job.seed)
        m = job.global_batch // job.microbatch_size
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        # every rank gets a loss_fn: torch pipelining runs backward only when one is given; the last stage calls it
        schedule = (
            ScheduleInterleavedZeroBubble([stage], n_microbatches=m, loss_fn=_cross_entropy)
            if job.schedule == "zb1p"
            else Schedule1F1B(stage, n_microbatches=m, loss_fn=_cross_entropy)
        )
        # fused, as the stages step (geosched.optim.MasterAdamW): the comparison is of runtimes, not optimizers
        optimizer = torch.optim.AdamW(module.parameters(), lr=job.learning_rate, fused=True)
        dataset = TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed)
        batches = [dataset.global_batch(step, job.global_batch) for step in range(steps)]  # (G, T) each
        times = []
        for inputs, targets in batches:
            t0 = time.time()
            if rank == 0:
                schedule.step(inputs)
            else:
                schedule.step(target=targets, losses=[])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append((t0, time.time()))
        dist.barrier()
        dist.destroy_process_group()
        results.put(("torch", rank, times))
    except BaseException as exc:  # noqa: BLE001
        results.put(("torch", rank, repr(exc)))


def run_torch(ctx: Any, job: JobSpec, layers: list[tuple[int, int]], steps: int) -> dict[int, list]:
    """Train ``steps`` steps with torch.distributed.pipelining on two pinned processes."""
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(rank, job, layers, port, steps, results)) for rank in range(2)]
    for p in procs:
        p.start()
    return collect(results, procs, "torch pipelining", timeout_s=600)
