"""Seeded random clusters and jobs for the planner's tests and benchmark.

``random_config(seed)`` draws a small but realistic case: 2-4 datacenters,
at most 64 GPUs in all, a GPT of at most 16 blocks, WAN links from 1 to
100 Gb/s with 5-150 ms RTT (some pairs unlinked), GPUs from 40 to 80 GiB.
Sizes are chosen so that compute, WAN transfers and memory all matter, and
small enough that the brute force can enumerate every plan. The jobs keep
their gradients in bf16 (``grad_dtype: precision``): the sizes were chosen for
2-byte gradients, and fp32 ones double the gradient syncs that make data
parallelism across DCs a real choice in them.
"""

from __future__ import annotations

import random

from geosched.config import Config, config_from_dict

GPU_KINDS = (("A100", 150.0, 80.0), ("A100-40G", 150.0, 40.0), ("H100", 400.0, 80.0), ("L40S", 90.0, 48.0))


def random_config(seed: int, max_dcs: int = 4, max_gpus: int = 64, max_layers: int = 16) -> Config:
    """A reproducible random cluster + job (see the module docstring for the ranges)."""
    rng = random.Random(seed)
    n = rng.randint(2, max_dcs)
    budget = max_gpus
    dcs = []
    for i in range(n):
        gpus = rng.choice([1, 2, 4, 4, 8, 8, 16, 16, 24, 32])
        gpus = max(1, min(gpus, budget - (n - i - 1)))
        budget -= gpus
        name, tflops, mem = rng.choice(GPU_KINDS)
        dcs.append(
            {
                "name": f"dc{i}",
                "gpus": gpus,
                "gpu": {"name": name, "tflops": tflops, "memory_gib": mem},
                "intra_bandwidth_gbps": rng.choice([100, 200, 400]),
                "intra_latency_us": rng.choice([5, 10]),
            }
        )
    links = []
    for i in range(n):
        for j in range(i + 1, n):
            if j != i + 1 and rng.random() < 0.35:
                continue  # some pairs are not linked; the chain dc0-dc1-... always is
            bandwidth = rng.choice([1, 2, 5, 10, 25, 40, 100])
            links.append(
                {
                    "between": [f"dc{i}", f"dc{j}"],
                    "bandwidth_gbps": bandwidth,
                    "rtt_ms": rng.choice([5, 10, 20, 40, 80, 150]),
                    "per_connection_gbps": min(bandwidth, rng.choice([0.5, 1, 2, 5, 10])),
                    "egress_usd_per_gb": rng.choice([0.01, 0.02, 0.05, 0.09]),
                }
            )
    hidden = rng.choice([1024, 2048, 4096])
    job = {
        "model": {
            "layers": rng.randint(2, max_layers),
            "hidden": hidden,
            "heads": hidden // 128,
            "seq_len": rng.choice([1024, 2048]),
            "vocab": rng.choice([32000, 50257]),
        },
        "global_batch": rng.choice([8, 16, 32]),
        "microbatch_size": rng.choice([1, 1, 2]),
        "precision": "bf16",
        "grad_dtype": "precision",
        "schedule": rng.choice(["1f1b", "1f1b", "gpipe"]),
        "recompute": rng.choice(["none", "full"]),
    }
    return config_from_dict(
        {"cluster": {"name": f"random-{seed}", "datacenters": dcs, "links": links}, "job": job},
        source=f"random_config({seed})",
    )


def two_datacenters(
    bandwidth_gbps: float, rtt_ms: float, per_connection_gbps: float, egress_usd_per_gb: float = 0.09
) -> Config:
    """Two datacenters of 8 H100s, "main" and "far", joined by one link with the given numbers.

    A 0.9B GPT with a large batch: with a fast link the plan spreads over
    both; behind a slow one "far" is not worth its WAN hop.
    """
    gpu = {"name": "H100", "tflops": 400, "memory_gib": 80}
    return config_from_dict(
        {
            "cluster": {
                "name": "two-dc",
                "datacenters": [{"name": "main", "gpus": 8, "gpu": gpu}, {"name": "far", "gpus": 8, "gpu": gpu}],
                "links": [
                    {
                        "between": ["main", "far"],
                        "bandwidth_gbps": bandwidth_gbps,
                        "rtt_ms": rtt_ms,
                        "per_connection_gbps": per_connection_gbps,
                        "egress_usd_per_gb": egress_usd_per_gb,
                    }
                ],
            },
            "job": {
                "model": {"layers": 16, "hidden": 4096, "heads": 32, "seq_len": 1024, "vocab": 32000},
                "global_batch": 64,
                "microbatch_size": 1,
                "grad_dtype": "precision",
            },
        },
        source="two_datacenters",
    )


def _two(name: str, dcs: list[dict[str, object]], link: dict[str, object], model: dict[str, int], batch: int) -> Config:
    return config_from_dict(
        {
            "cluster": {"name": name, "datacenters": dcs, "links": [{"between": [d["name"] for d in dcs], **link}]},
            "job": {"model": model, "global_batch": batch},
        },
        source=name,
    )


def campus_two_datacenters() -> Config:
    """Two DCs of 8 A100s on a campus-grade link (200 Gb/s, 0.1 ms RTT) and a 1.3B GPT that fits one GPU:
    data parallelism across both DCs is the plan to beat."""
    gpu = {"name": "A100", "tflops": 150, "memory_gib": 80}
    return _two(
        "campus-2dc",
        [{"name": "a", "gpus": 8, "gpu": gpu}, {"name": "b", "gpus": 8, "gpu": gpu}],
        {"bandwidth_gbps": 200, "rtt_ms": 0.1, "per_connection_gbps": 25},
        {"layers": 24, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 50257},
        512,
    )


def mixed_speed_two_datacenters() -> Config:
    """A DC of 32 fast GPUs (600 TFLOP/s) and one of 32 slow ones (200 TFLOP/s) on a 50 Gb/s, 20 ms link."""
    return _two(
        "mixed-speed-2dc",
        [
            {"name": "fast", "gpus": 32, "gpu": {"name": "B200", "tflops": 600, "memory_gib": 80}},
            {"name": "slow", "gpus": 32, "gpu": {"name": "A100", "tflops": 200, "memory_gib": 80}},
        ],
        {"bandwidth_gbps": 50, "rtt_ms": 20, "per_connection_gbps": 5},
        {"layers": 48, "hidden": 4096, "heads": 32, "seq_len": 2048, "vocab": 50257},
        256,
    )


REGIONS = ("na", "eu", "ap", "sa")


def regional_config(seed: int, dcs: int = 32, gpus: int = 512) -> Config:
    """A large seeded cluster like ``configs/scale-16dc.yaml``: ``dcs`` datacenters of ``gpus`` H100s in up to
    four regions, every pair inside a region linked (200 Gb/s, 5-30 ms), about half of the cross-region
    pairs linked (10-50 Gb/s, 70-200 ms), and a 70B-class GPT (80 blocks). For the planner's wall time."""
    rng = random.Random(seed)
    regions = REGIONS[: max(1, min(len(REGIONS), dcs // 4))]
    names = [f"{regions[i % len(regions)]}{i // len(regions) + 1}" for i in range(dcs)]
    gpu = {"name": "H100", "tflops": 400, "memory_gib": 80}
    links = []
    for i in range(dcs):
        for j in range(i + 1, dcs):
            same = names[i][:2] == names[j][:2]
            if not same and rng.random() < 0.5:
                continue
            bandwidth = 200 if same else rng.choice([10, 25, 50])
            links.append(
                {
                    "between": [names[i], names[j]],
                    "bandwidth_gbps": bandwidth,
                    "rtt_ms": rng.randint(5, 30) if same else rng.randint(70, 200),
                    "per_connection_gbps": 10 if same else 2,
                    "egress_usd_per_gb": 0.01 if same else 0.05,
                }
            )
    job = {
        "model": {"layers": 80, "hidden": 8192, "heads": 64, "seq_len": 4096, "vocab": 128256},
        "global_batch": 2048,
        "microbatch_size": 1,
        "precision": "bf16",
        "optimizer_bytes_per_param": 12,
        "schedule": "1f1b",
        "recompute": "full",
    }
    datacenters = [{"name": name, "gpus": gpus, "gpu": gpu} for name in names]
    return config_from_dict(
        {"cluster": {"name": f"regional-{dcs}dc-{seed}", "datacenters": datacenters, "links": links}, "job": job},
        source=f"regional_config({seed}, {dcs}, {gpus})",
    )
