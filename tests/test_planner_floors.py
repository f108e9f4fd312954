"""The floors know which GPUs a pipeline can have: slow ones, few fast ones, DCs behind long round trips, many links.

Each floor is checked against every candidate the brute force simulates (the floors must bound them all) and
against the best of them (how close it is)."""

from __future__ import annotations

import dataclasses

import pytest

from geosched.config import Config, config_from_dict
from planner.bruteforce import brute_force, enumerable
from planner.evaluate import Evaluation, Evaluator
from planner.floors import Floors, job_floors
from planner.space import Problem

H100 = {"name": "H100", "tflops": 400, "memory_gib": 80}
L40S = {"name": "L40S", "tflops": 90, "memory_gib": 48}


def few_fast(fast: int, rtt_ms: float = 2) -> Config:
    """``fast`` H100s and 16 L40S (4.4x slower) in two DCs on a 100 Gb/s link, a 0.5B GPT of 16 sequences."""
    return config_from_dict(
        {
            "cluster": {
                "name": "few-fast",
                "datacenters": [{"name": "fast", "gpus": fast, "gpu": H100}, {"name": "slow", "gpus": 16, "gpu": L40S}],
                "links": [
                    {"between": ["fast", "slow"], "bandwidth_gbps": 100, "rtt_ms": rtt_ms, "per_connection_gbps": 25}
                ],
            },
            "job": {
                "model": {"layers": 8, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 32000},
                "global_batch": 16,
                "microbatch_size": 1,
                "tensor_parallel": 1,
                "zero": 1,
                "grad_dtype": "precision",  # bf16 gradients: the floors' margins below were set for them
            },
        },
        source="few_fast",
    )


def every_gpu_fast(cfg: Config) -> Config:
    """``cfg`` with every DC's GPUs replaced by the first DC's."""
    gpu = cfg.cluster.datacenters[0].gpu
    dcs = tuple(dataclasses.replace(dc, gpu=gpu) for dc in cfg.cluster.datacenters)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, datacenters=dcs))


def bounded_brute_force(problem: Problem, floors: Floors) -> Evaluation:
    """The brute force's best plan, every candidate it simulated checked against ``floors``."""
    assert enumerable(problem)
    evaluator = Evaluator(problem)
    best, _ = brute_force(problem, evaluator)
    assert evaluator.evaluated
    for ev in evaluator.evaluated:
        assert ev.iteration_s >= floors.best_s * (1 - 1e-9), ev.candidate.describe()
    return best


@pytest.mark.parametrize("fast", [1, 2, 4])
def test_pipelines_that_cannot_all_have_the_fast_gpus_are_bounded_at_the_slow_ones_speed(fast: int) -> None:
    """A few H100s beside many L40S: every pipeline but a few runs on L40S, so the floor is at least 1.7x what
    it would be were every GPU an H100, and within 65 % of the best plan."""
    problem = Problem(few_fast(fast))
    floors = job_floors(problem)
    best = bounded_brute_force(problem, floors)
    assert floors.best_s > 1.7 * job_floors(Problem(every_gpu_fast(few_fast(fast)))).best_s
    assert best.iteration_s < 1.65 * floors.best_s


def test_a_long_round_trip_keeps_the_floor_inside_one_dc() -> None:
    """Behind a 150 ms round trip no pipeline that crosses the link can beat one inside a DC: the floor is that
    of the DCs alone, each at its own GPUs' speed, within 10 % of the best plan (16 L40S replicas)."""
    problem = Problem(few_fast(2, rtt_ms=150))
    floors = job_floors(problem)
    best = bounded_brute_force(problem, floors)
    assert best.candidate.path == ("slow",)
    assert floors.best_s > 0.9 * best.iteration_s
    assert floors.best_s > job_floors(Problem(few_fast(2))).best_s  # the round trip raised it


def test_the_wan_floor_spreads_the_messages_over_every_link() -> None:
    """Three DCs of 2 GPUs, none able to hold the model, every pair linked: pipelines on different paths can
    cross different links, so the WAN floor divides the sequences' messages by the three links' rates, then
    adds the last message's gradient and a round trip. (No plan fits these GPUs: the floors' memory relaxation
    is looser than the memory rule, so a WAN floor above 0 and a plan rarely meet.)"""
    tiny = {"name": "small", "tflops": 100, "memory_gib": 0.9}
    link = {"bandwidth_gbps": 2, "rtt_ms": 20, "per_connection_gbps": 1}
    cfg = config_from_dict(
        {
            "cluster": {
                "name": "triangle",
                "datacenters": [{"name": name, "gpus": 2, "gpu": tiny} for name in "abc"],
                "links": [{"between": list(pair), **link} for pair in ("ab", "ac", "bc")],
            },
            "job": {
                "model": {"layers": 8, "hidden": 2048, "heads": 16, "seq_len": 1024, "vocab": 32000},
                "global_batch": 16,
                "microbatch_size": 1,
                "recompute": "full",
                "tensor_parallel": 1,
                "zero": 1,
                "grad_dtype": "precision",  # 16 bytes a parameter: 0.9 GiB holds a third of the model
            },
        },
        source="triangle",
    )
    problem = Problem(cfg)
    floors = job_floors(problem)
    message = 1024 * 2048 * 2 * 8  # bits of one sequence's bf16 activation
    assert floors.min_stages == 3
    assert floors.wan_s == pytest.approx(16 * message / (3 * 2e9) + message / 2e9 + 0.020)
