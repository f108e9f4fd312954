"""Benchmark intra-DC all-reduce: native gloo vs the seeds' ring vs the two naive schemes.

G processes (spawned, one gloo group on 127.0.0.1, store on an OS-picked
port) all-reduce float32 tensors of 1 MiB to 256 MiB with each scheme, runs
interleaved round-robin so machine noise hits all schemes alike. For each
(G, size, scheme) it reports the best and median time (a run's time is the
slowest rank's, all ranks starting after a barrier), the CPU time of the
busiest rank (robust when other work shares the cores), the bus bandwidth as
nccl-tests define it, busbw = 2(G-1)/G * bytes / best time, and the elements each
rank sent against the formulas: ring 2(G-1)N/G per rank, all-to-all G(G-1)N
in total, gather-then-broadcast 2(G-1)N through the root.

G = 4 on a 2-core machine is oversubscribed (4 busy processes on 2 cores):
its times say more about the scheduler than the algorithms.

Examples::

    python benchmarks/allreduce.py --quick          # G=2; 1, 16, 64 MiB; under a minute
    python benchmarks/allreduce.py --json           # last line: one JSON object
    python benchmarks/allreduce.py --groups 2 4 --sizes-mib 1 4 16 64 256
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from common import benchmark_parser, emit, in_range, positive_int

MIB = 1 << 20
SCHEMES = ("native", "ring", "all_to_all", "gather_broadcast")


def _worker(group: Any, sizes_mib: list[int], reps: int) -> dict[str, Any]:
    """Inside one rank: time every scheme on every size; count elements sent and received."""
    import torch

    from agents.dp import ring

    fns = {
        "native": lambda t, c: group.allreduce(t),
        "ring": lambda t, c: ring.ring_allreduce(t, counter=c),
        "all_to_all": lambda t, c: ring.all_to_all_allreduce(t, counter=c),
        "gather_broadcast": lambda t, c: ring.gather_broadcast_allreduce(t, counter=c),
    }
    out: dict[str, Any] = {}
    for mib in sizes_mib:
        x = torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(group.rank))
        counters = {name: ring.ElementCounter() for name in SCHEMES}
        times: dict[str, list[float]] = {name: [] for name in SCHEMES}
        cpu: dict[str, list[float]] = {name: [] for name in SCHEMES}
        for rep in range(reps + 1):  # the first round warms up (allocations, connections)
            for name in SCHEMES:
                group.barrier()
                counter = counters[name] if rep == 0 else None
                start, start_cpu = time.perf_counter(), time.process_time()
                fns[name](x, counter)
                if rep:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
        out[str(mib)] = {
            name: {
                "times": times[name],
                "cpu": cpu[name],
                "sent": counters[name].sent_elements,
                "received": counters[name].received_elements,
            }
            for name in SCHEMES
        }
        del x
        ring.release_scratch()
    return out


def _grad_worker(group: Any, layers: int, width: int, reps: int) -> dict[str, list[float]]:
    """Inside one rank: backward of a stage-like MLP, then its gradient sync done three ways.

    per_tensor: one blocking all-reduce per parameter; explicit:
    ``group.allreduce_gradients`` (flat persistent buckets, all in flight);
    ddp: ``group.wrap`` (DDP buckets, overlapped with backward). Each time is
    backward + sync, so they compare directly.
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])  # (B, width) -> (B, width)
    ddp = group.wrap(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]))
    x, upstream = torch.randn(8, width), torch.randn(8, width)

    def per_tensor() -> None:
        torch.autograd.backward(model(x), upstream)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(group.size)

    def explicit() -> None:
        torch.autograd.backward(model(x), upstream)
        group.allreduce_gradients(model)

    def with_ddp() -> None:
        torch.autograd.backward(ddp(x), upstream)

    def backward_only() -> None:
        torch.autograd.backward(model(x), upstream)

    fns = {"backward_only": backward_only, "per_tensor": per_tensor, "explicit": explicit, "ddp": with_ddp}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            group.barrier()
            start = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - start)
    return times


def _summarise(g: int, per_rank: list[dict[str, Any]], sizes_mib: list[int]) -> list[dict[str, Any]]:
    from agents.dp import ring

    rows = []
    for mib in sizes_mib:
        n, nbytes = mib * MIB // 4, mib * MIB
        for name in SCHEMES:
            runs = [
                max(r[str(mib)][name]["times"][i] for r in per_rank)
                for i in range(len(per_rank[0][str(mib)][name]["times"]))
            ]
            best, median = min(runs), statistics.median(runs)
            cpu = statistics.median(max(r[str(mib)][name]["cpu"][i] for r in per_rank) for i in range(len(runs)))
            sent = [r[str(mib)][name]["sent"] for r in per_rank]
            received = [r[str(mib)][name]["received"] for r in per_rank]
            row = {
                "G": g,
                "MiB": mib,
                "scheme": name,
                "best_ms": best * 1e3,
                "median_ms": median * 1e3,
                "cpu_ms": cpu * 1e3,
                "busbw_GBps": 2 * (g - 1) / g * nbytes / best / 1e9,
                "sent_per_rank_max": max(sent),
                "sent_total": sum(sent),
            }
            if name == "ring":
                row["theory"] = ring.ring_elements_per_rank(n, g)
                row["measured_vs_theory"] = max(sent) / row["theory"]
            elif name == "all_to_all":
                row["theory"] = ring.all_to_all_elements_total(n, g)
                row["measured_vs_theory"] = sum(sent) / row["theory"]
            elif name == "gather_broadcast":
                row["root_elements"] = sent[0] + received[0]
                row["theory"] = ring.gather_broadcast_root_elements(n, g)
                row["measured_vs_theory"] = row["root_elements"] / row["theory"]
            rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    native = {(r["G"], r["MiB"]): r["median_ms"] for r in rows if r["scheme"] == "native"}
    lines = [
        f"{'G':>2} {'MiB':>5} {'scheme':<17} {'best ms':>8} {'median ms':>9} {'cpu ms':>7} {'busbw GB/s':>10} "
        f"{'native/this':>11} {'sent/theory':>11}"
    ]
    for r in rows:
        counts = f"{r['measured_vs_theory']:.4f}" if "theory" in r else "-"
        lines.append(
            f"{r['G']:>2} {r['MiB']:>5} {r['scheme']:<17} {r['best_ms']:>8.1f} {r['median_ms']:>9.1f} "
            f"{r['cpu_ms']:>7.1f} {r['busbw_GBps']:>10.2f} "
            f"{native[(r['G'], r['MiB'])] / r['median_ms']:>11.2f} {counts:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print a table and ratios (and, with --json, one JSON object last)."""
    parser = benchmark_parser(__doc__, "G=2; 1, 16, 64 MiB only (under a minute)")
    parser.add_argument(
        "--groups", type=in_range(2, 16, whole=True), nargs="+", default=[2, 4], help="group sizes G (default 2 4)"
    )
    parser.add_argument(
        "--sizes-mib", type=in_range(1, 4096, whole=True), nargs="+", default=[1, 4, 16, 64, 256], help="tensor sizes"
    )
    parser.add_argument("--reps", type=positive_int, default=7, help="timed runs per scheme and size (default 7)")
    parser.add_argument(
        "--grad-layers", type=in_range(1, 1024, whole=True), default=48, help="Linear layers of the gradient-sync model"
    )
    parser.add_argument(
        "--grad-width",
        type=in_range(1, 16384, whole=True),
        default=512,
        help="width of those layers (48 x 512: 48 MiB)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.groups, args.sizes_mib = [2], [1, 16, 64]

    from agents.dp.local_group import run_local_group

    rows: list[dict[str, Any]] = []
    for g in args.groups:
        started = time.monotonic()
        results = run_local_group(
            _worker, g, sorted(args.sizes_mib), args.reps, timeout_s=120.0, deadline_s=3600.0, name=f"bench/g{g}"
        )
        failed = [f"rank {r.rank}: {r.error or f'exit code {r.exitcode}'}" for r in results if r.value is None]
        if failed:
            print(f"allreduce benchmark: G={g} failed: {'; '.join(failed)}", file=sys.stderr)
            return 1
        rows += _summarise(g, [r.value for r in results], sorted(args.sizes_mib))
        print(f"# G={g}: {time.monotonic() - started:.1f} s" + (" (oversubscribed: G > cores)" if g > 2 else ""))
    print(_table(rows))

    g0 = args.groups[0]
    grad_results = run_local_group(
        _grad_worker,
        g0,
        args.grad_layers,
        args.grad_width,
        args.reps,
        timeout_s=120.0,
        deadline_s=600.0,
        name="bench/grads",
    )
    if any(r.value is None for r in grad_results):
        print(f"allreduce benchmark: gradient sync failed: {[r.error for r in grad_results]}", file=sys.stderr)
        return 1
    grad_ms = {
        name: 1e3 * min(max(r.value[name][i] for r in grad_results) for i in range(args.reps))
        for name in grad_results[0].value
    }
    grad_mib = args.grad_layers * (args.grad_width + 1) * args.grad_width * 4 / MIB
    print(
        f"\ngradient sync, G={g0}, {args.grad_layers} x Linear({args.grad_width}) = {grad_mib:.0f} MiB of "
        f"gradients in {2 * args.grad_layers} tensors (backward + sync, best of {args.reps}):"
    )
    for name, ms in grad_ms.items():
        print(f"  {name:<14} {ms:8.1f} ms")

    def pick(g: int, mib: int, scheme: str) -> dict[str, Any] | None:
        return next((r for r in rows if (r["G"], r["MiB"], r["scheme"]) == (g, mib, scheme)), None)

    ref_mib = 64 if 64 in args.sizes_mib else max(args.sizes_mib)
    native, ring_row = pick(g0, ref_mib, "native"), pick(g0, ref_mib, "ring")
    a2a, gb = pick(g0, ref_mib, "all_to_all"), pick(g0, ref_mib, "gather_broadcast")
    assert native and ring_row and a2a and gb
    result = {
        f"ring_vs_native_{ref_mib}MiB": native["median_ms"] / ring_row["median_ms"],
        f"ring_vs_native_{ref_mib}MiB_best": native["best_ms"] / ring_row["best_ms"],
        f"ring_vs_native_{ref_mib}MiB_cpu": native["cpu_ms"] / ring_row["cpu_ms"],
        "ring_elements_vs_theory": max(r["measured_vs_theory"] for r in rows if r["scheme"] == "ring"),
        "naive_all_to_all_elements": a2a["sent_total"],
        "naive_all_to_all_theory": a2a["theory"],
        "gather_broadcast_root_elements": gb["root_elements"],
        "gather_broadcast_root_theory": gb["theory"],
        "explicit_vs_per_tensor": grad_ms["per_tensor"] / grad_ms["explicit"],
        "explicit_vs_ddp": grad_ms["ddp"] / grad_ms["explicit"],
        "grad_sync_ms": grad_ms,
        "G": g0,
        "MiB": ref_mib,
        "rows": rows,
    }
    key = f"ring_vs_native_{ref_mib}MiB"
    print(
        f"ring vs native at G={g0}, {ref_mib} MiB: native/ring time = {result[key]:.2f} (median), "
        f"{result[key + '_best']:.2f} (best); CPU time {result[key + '_cpu']:.2f}; target >= 0.8"
    )
    print(
        f"explicit bucketed gradient sync vs one all-reduce per tensor: {result['explicit_vs_per_tensor']:.2f}x "
        f"faster; vs DDP: {result['explicit_vs_ddp']:.2f}x"
    )
    print(
        f"ring elements sent / 2(G-1)N/G = {result['ring_elements_vs_theory']:.6f}; "
        f"all-to-all total {a2a['sent_total']} = G(G-1)N {a2a['theory']}; "
        f"gather-broadcast root {gb['root_elements']} = 2(G-1)N {gb['theory']}"
    )
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
