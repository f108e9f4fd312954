"""Collectives measured between a plan's co-located ranks: fitted, kept in the calibration, priced by the cost model."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import yaml

from agents.rehearsal.calibrate import calibrate
from agents.rehearsal.collective_profile import RankGroup, fit_ring
from geosched.config import load_config
from geosched.costmodel import Calibration, stage_compute, tp_allreduce_s, tp_gather_s
from geosched.netcost import ring_allreduce_s
from geosched.pipeline_costs import PipelineCosts

DEMO = "configs/demo-3dc.yaml"
TINY = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 32, "vocab": 256}
PIECES = {
    "gpu_name": "cpu",
    "tflops": 0.5,
    **{f"{p}_{d}_s": 1e-4 for p in ("block", "head", "embed") for d in ("forward", "backward")},
}


def tiny_config(tmp_path):
    """The demo cluster with a 2-layer model, microbatch 2, a global batch of 4."""
    data = yaml.safe_load(open(DEMO))
    data["job"].update(model=TINY, microbatch_size=2, global_batch=4)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_a_calibration_written_before_collectives_were_measured_still_loads(tmp_path) -> None:
    config = tiny_config(tmp_path)
    job = dataclasses.replace(config.job, tensor_parallel=2)
    dc = config.cluster.dc("us")
    old = Calibration.from_dict(
        {
            **PIECES,
            "stage_times": [{"start": 0, "end": 2, "first": True, "last": True, "forward_s": 1, "backward_s": 2}],
        }
    )
    assert old.collectives is None
    assert old.stage_time((0, 2), True, True) is not None  # an old stage entry was measured unsharded
    assert old.stage_time((0, 2), True, True, tp=2) is None
    assert tp_allreduce_s(job, dc, old) == tp_allreduce_s(job, dc)  # the config's node link, as before
    assert tp_gather_s(job, dc, 4096, old) == tp_gather_s(job, dc, 4096)


def test_a_tensor_parallel_stage_measured_whole_holds_its_all_reduces() -> None:
    cal = Calibration.from_dict(
        {
            **PIECES,
            "stage_times": [
                {"start": 0, "end": 2, "first": True, "last": False, "forward_s": 0.01, "backward_s": 0.02, "tp": 2}
            ],
        }
    )
    job = dataclasses.replace(load_config(DEMO).job, tensor_parallel=2)
    c = stage_compute(job, cal.tflops, (0, 2), True, False, cal, tp_allreduce=1.0)
    assert c.forward_s == pytest.approx(0.01 * job.batch)  # not divided by t, no all-reduce added on top
    assert c.backward_s == pytest.approx(0.02 * job.batch)


def test_a_stage_measured_with_its_all_reduce_is_priced_with_it(tmp_path) -> None:
    config = tiny_config(tmp_path)
    job = config.job
    stage = {"start": 0, "end": 2, "first": True, "last": True, "forward_s": 0.01, "backward_s": 0.02}
    fit = {"kind": "all_reduce", "group": 2, "latency_s": 1e-3, "bandwidth_bps": 1e9}
    measured = Calibration.from_dict(
        {**PIECES, "stage_times": [{**stage, "dp": 2, "sync_s": 0.007}], "collectives": [fit]}
    )
    costs = PipelineCosts(config.cluster, job, ["us"], [(0, 2)], 2, {}, calibration=measured)
    assert costs.allreduce_s(0) == pytest.approx(0.007)
    other_dp = Calibration.from_dict(
        {**PIECES, "stage_times": [{**stage, "dp": 4, "sync_s": 0.007}], "collectives": [fit]}
    )
    costs = PipelineCosts(config.cluster, job, ["us"], [(0, 2)], 2, {}, calibration=other_dp)
    assert costs.allreduce_s(0) == ring_allreduce_s(costs.grad_bytes[0], 2, 1e9, 1e-3)  # measured at another dp
    older = Calibration.from_dict({**PIECES, "stage_times": [{**stage, "dp": 2}], "collectives": [fit]})
    assert older.stage_times[0].sync_s is None  # files written before sync_s was measured load as before
    costs = PipelineCosts(config.cluster, job, ["us"], [(0, 2)], 2, {}, calibration=older)
    assert costs.allreduce_s(0) == ring_allreduce_s(costs.grad_bytes[0], 2, 1e9, 1e-3)


def test_the_ring_fit_recovers_latency_and_bandwidth() -> None:
    for kind, share in (("all_reduce", 1.0), ("all_gather", 0.5)):
        samples = [(n, share * ring_allreduce_s(n, 4, 2e9, 3e-4)) for n in (1e4, 1e5, 1e6)]
        latency, bps = fit_ring(kind, 4, samples)
        assert latency == pytest.approx(3e-4)
        assert bps == pytest.approx(2e9)


@pytest.mark.slow
def test_collectives_are_measured_between_real_ranks_and_priced_with(tmp_path) -> None:
    config = tiny_config(tmp_path)
    job = config.job
    group = RankGroup((0, 2), True, True, dp=2)  # one stage, two replicas in one gloo group
    cal = Calibration.from_dict(calibrate(job, repeats=1, warmup=0, link=False, ranks=[group]))

    fit = cal.collective("all_reduce", 2)
    assert fit is not None and fit.latency_s > 0 and fit.bandwidth_bps > 0 and fit.samples > 0
    assert cal.collective("all_gather", 2) is not None
    whole = cal.stage_time((0, 2), True, True)
    assert whole is not None and whole.dp == 2 and whole.step_s is not None and whole.step_s > 0

    assert whole.sync_s is not None and whole.sync_s > 0
    costs = PipelineCosts(config.cluster, job, ["us"], [(0, 2)], 2, {}, calibration=cal)
    assert costs.allreduce_s(0) == whole.sync_s  # the stage's ALL_REDUCE as measured
    unmeasured = dataclasses.replace(cal, stage_times=())  # other stages: the measured ring
    costs = PipelineCosts(config.cluster, job, ["us"], [(0, 2)], 2, {}, calibration=unmeasured)
    assert costs.allreduce_s(0) == ring_allreduce_s(costs.grad_bytes[0], 2, fit.bandwidth_bps, fit.latency_s)
    dc = config.cluster.dc("us")
    tp2 = dataclasses.replace(job, tensor_parallel=2)  # a tp all-reduce over 2 ranks: the same measured ring
    nbytes = job.batch * job.model.seq_len * job.model.hidden * job.bytes_per_element
    assert tp_allreduce_s(tp2, dc, cal) == ring_allreduce_s(nbytes, 2, fit.bandwidth_bps, fit.latency_s)
    assert tp_allreduce_s(tp2, dc, cal) != tp_allreduce_s(tp2, dc)


def test_a_zero_bubble_plan_measures_each_stage_s_input_and_weight_passes(tmp_path) -> None:
    """A ZB-H1 plan's later stage, sharded over tp 2, times its I and W as its runtime runs them; they price it."""
    job = dataclasses.replace(tiny_config(tmp_path).job, schedule="zb1p", tensor_parallel=2)
    group = RankGroup((1, 2), False, True, tp=2)
    cal = Calibration.from_dict(calibrate(job, repeats=2, warmup=1, link=False, ranks=[group]))
    whole = cal.stage_time((1, 2), False, True, 2)
    assert whole is not None and whole.input_backward_s is not None and whole.weight_backward_s is not None
    assert whole.input_backward_s > 0 and whole.weight_backward_s > 0
    priced = stage_compute(job, cal.tflops, (1, 2), False, True, cal)
    b = job.microbatch_size
    assert (priced.backward_input_s, priced.backward_weight_s) == (
        whole.input_backward_s * b,
        whole.weight_backward_s * b,
    )


def _calibration_optimizers(group: Any, job: Any) -> dict[int, dict[str, Any]]:
    """On one rank of a dp 2 x tp 2 group: the optimizer the calibration steps at each ZeRO stage, and whether
    its ALL_REDUCE and STEP changed the weights."""
    from agents.rehearsal.collective_profile import _step_parts
    from agents.tp.mesh import stage_mesh
    from agents.tp.shard import shard_stage
    from geosched.model import build_stage

    out = {}
    g = RankGroup((0, 2), True, True, dp=2, tp=2)
    for zero in (0, 1, 2):
        module = build_stage(job.model, 0, 2, first=True, last=True, seed=job.seed)
        mesh = stage_mesh(2, 2)
        shard_stage(module, mesh["tp"])
        optimizer, all_reduce = _step_parts(dataclasses.replace(job, zero=zero), g, module, group, mesh)
        tokens = torch.randint(0, job.model.vocab, (job.batch, job.model.seq_len + 1), generator=torch.Generator())
        module.loss(module(tokens[:, :-1]), tokens[:, 1:]).backward()
        before = [p.to_local().clone() if hasattr(p, "to_local") else p.detach().clone() for p in module.parameters()]
        all_reduce()
        optimizer.step()
        after = [p.to_local() if hasattr(p, "to_local") else p.detach() for p in module.parameters()]
        out[zero] = {
            "optimizer": type(optimizer).__name__,
            "changed": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        }
    return out


@pytest.mark.slow
def test_the_calibration_steps_a_tensor_parallel_stage_with_the_job_s_zero_optimizer(tmp_path) -> None:
    """With tp and replicas, the calibration's STEP is the optimizer the stage runtime builds at the job's ZeRO
    stage (its state sharded over the mesh's dp group), not plain AdamW over the local shards."""
    from agents.dp.local_group import run_local_group

    job = tiny_config(tmp_path).job
    outcomes = run_local_group(_calibration_optimizers, 4, job, timeout_s=60.0, deadline_s=240.0, name="cal-zero")
    for outcome in outcomes:
        assert outcome.error is None, f"rank {outcome.rank}: {outcome.error}"
        assert outcome.value == {
            0: {"optimizer": "LocalShardAdamW", "changed": True},
            1: {"optimizer": "ShardedStateAdamW", "changed": True},
            2: {"optimizer": "ShardedGradAdamW", "changed": True},
        }
