"""Benchmark prefill-as-a-service: fill pipeline bubbles with inference prefill without slowing training.

Two pipeline stages train one GPT (1F1B) in two processes, each pinned to
its own core (``os.sched_setaffinity``), joined by a real WanLink through
a WAN emulator relay (RTT and link cap), set up exactly as ``geosched``
runs ranks (:class:`agents.stage.session.RankSession`, a routed address book and a
:class:`agents.stage.transport.RelayRouter`). Each stage serves prefill
(:class:`agents.prefill.service.PrefillService`, the whole model loaded
once) and fills the bubbles its runtime meets. After a few warm-up steps,
phases without and with prefill load alternate in one run; the client
(this process) keeps a fixed number of prompts outstanding per stage during
the "with" phases.

Reported (first step of every phase left out, it straddles the switch):
busy fraction = (training compute + prefill compute) / iteration time per
stage without and with load; training slowdown = median iteration time
with / without; prefill tokens/s (both stages) during the load phases;
TTFT p50/p99 measured by the client; requests lost (sent - answered).
Targets: busy with prefill >= 0.94, slowdown <= 1.02.

Examples::

    python benchmarks/bubbletea.py --quick
    python benchmarks/bubbletea.py --json          # last line: one JSON object
    python benchmarks/bubbletea.py --rtt-ms 40 --phase-steps 20 --phases 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from common import (
    benchmark_parser,
    cpu_for,
    emit,
    in_range,
    join_or_kill,
    pin_one_thread,
    positive_float,
    positive_int,
)

PROMPT_TOKENS, SEQ_LEN = 48, 64  # defaults of --prompt-tokens and --seq-len
HEADS = 4  # the model's attention heads


def _rank_main(
    role: Any,
    job: Any,
    store_port: int,
    core: int | None,
    steps: int,
    step_seen: Any,
    results: Any,
    stop: Any,
    service_options: dict,
) -> None:
    """One stage: pinned to ``core``, serving prefill, training ``steps`` steps with the bubble filler on."""
    try:
        pin_one_thread(core)
        from agents.prefill.service import PrefillService
        from agents.stage.session import RankSession
        from agents.stage.transport import StoreAddressBook
        from geosched.data import default_corpus_paths
        from geosched.model import build_model

        sys.setswitchinterval(service_options.pop("switch_interval_s"))  # GIL hand-over to the link's I/O threads
        model = build_model(job.model, seed=job.seed + 1).eval()  # the served model: any GPT of this project
        book = StoreAddressBook.connect("127.0.0.1", store_port, routed=True)
        with PrefillService(model, **service_options) as service:
            results.put(("endpoint", role.stage, service.endpoint))
            with RankSession(
                job,
                role,
                data=default_corpus_paths(),
                addresses=book,
                connect_timeout_s=60,
                recv_timeout_s=60,
                bubble_filler=service,
            ) as session:
                for report in session.train(steps):
                    service.record_step(report.busy_s, report.iteration_s)
                    if role.stage == 0:
                        step_seen.value = report.step + 1
                    prefill_s = sum(e.end - e.start for e in report.events if e.category == "prefill")
                    chunks = sum(1 for e in report.events if e.category == "prefill")
                    results.put(
                        (
                            "step",
                            role.stage,
                            {
                                "step": report.step,
                                "iteration_s": report.iteration_s,
                                "busy_s": report.busy_s,
                                "idle_s": report.idle_s,
                                "comm_s": report.comm_s,
                                "prefill_s": prefill_s,
                                "chunks": chunks,
                                "loss": report.loss,
                                "tokens": service.metrics_.prefill_tokens,
                            },
                        )
                    )
            results.put(("metrics", role.stage, service.metrics()))
            service.serve_idle(stop.is_set)  # training is over: answer what is still queued, until the client is done
    except BaseException:  # noqa: BLE001 - handed to the parent
        results.put(("error", role.stage, traceback.format_exc()))


def _load_on(step: int, warmup: int, phase: int) -> bool:
    """Whether the client sends during ``step``: odd phases, except their last step (the queue drains)."""
    return step >= warmup and ((step - warmup) // phase) % 2 == 1 and (step - warmup) % phase != phase - 1


def _client_main(out: Any, *client_args: Any) -> None:
    """Client process: :func:`_client`'s report (or its error) put on ``out``."""
    try:
        out.put(_client(*client_args))
    except BaseException:  # noqa: BLE001 - handed to the parent
        out.put({"error": traceback.format_exc()})


def _client(
    endpoints: list[str],
    step_seen: Any,
    warmup: int,
    phase: int,
    outstanding: int,
    training_done: Any,
    deadline_s: float,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict[str, Any]:
    """Keep ``outstanding`` prompts in flight per endpoint during load steps; the answers and their TTFT."""
    import torch
    import zmq

    from agents.prefill.client import PrefillClient

    gen = torch.Generator().manual_seed(0)
    clients = [PrefillClient(e, timeout_s=10) for e in endpoints]
    sent_at: dict[str, float] = {}
    in_flight = [0] * len(clients)
    statuses: dict[str, str] = {}
    ttft: list[float] = []
    poller = zmq.Poller()
    for c in clients:
        poller.register(c._sock, zmq.POLLIN)  # noqa: SLF001 - one poller over both clients' sockets
    give_up = None
    try:
        while not training_done.is_set() or any(in_flight):
            if training_done.is_set() and give_up is None:
                give_up = time.monotonic() + 3 * deadline_s
            if give_up is not None and time.monotonic() > give_up:
                break  # answers still missing count as lost
            if not training_done.is_set() and _load_on(step_seen.value, warmup, phase):
                for i, c in enumerate(clients):
                    while in_flight[i] < outstanding:
                        prompt = torch.randint(0, 256, (prompt_tokens,), generator=gen)
                        sent_at[c.submit(prompt, deadline_s=deadline_s, return_kv=True)] = time.perf_counter()
                        in_flight[i] += 1
            ready = dict(poller.poll(20))
            for i, c in enumerate(clients):
                if c._sock in ready:  # noqa: SLF001
                    while c._sock.poll(0):  # noqa: SLF001
                        answer = c.receive(1)
                        statuses[answer.id or "?"] = answer.status
                        in_flight[i] -= 1
                        if answer.status == "ok":
                            ttft.append(time.perf_counter() - sent_at[answer.id])  # type: ignore[index]
    finally:
        for c in clients:
            c.close()
    return {"sent": len(sent_at), "statuses": statuses, "ttft_s": ttft}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the relay, both stages and the client; return the figures."""
    import torch.distributed as dist

    from agents.layout import layout_roles
    from agents.stage.transport import RelayRouter, StoreAddressBook, pipeline_routes
    from agents.wanem.emulator import LinkShape
    from geosched.config import JobSpec, ModelSpec

    job = JobSpec(
        model=ModelSpec(layers=args.layers, hidden=args.hidden, heads=HEADS, seq_len=args.seq_len),
        global_batch=args.microbatches * 2,
        microbatch_size=2,
        precision="fp32",
        schedule="1f1b",
        seed=3,
        learning_rate=1e-3,
    )
    roles = layout_roles(["a", "b"], [(0, args.layers // 2), (args.layers // 2, args.layers)], dp=1, wan_streams=2)
    shape = LinkShape(rtt_ms=args.rtt_ms, link_bytes_per_s=args.link_mbit * 1e6 / 8)
    warmup, phase = args.warmup_steps, args.phase_steps
    steps = warmup + 2 * args.phases * phase

    def phase_of(step: int) -> str | None:
        """'off' / 'on' for measured steps; None for warm-up and the first step of each phase."""
        if step < warmup or (step - warmup) % phase == 0:
            return None
        return "on" if ((step - warmup) // phase) % 2 else "off"

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    router = RelayRouter(
        StoreAddressBook.connect("127.0.0.1", store.port, routed=True), pipeline_routes(roles, lambda a, b: shape)
    ).start()
    ctx = mp.get_context("spawn")
    results, step_seen, stop = ctx.Queue(), ctx.Value("i", 0), ctx.Event()
    options = {
        "max_queue": 2 * args.outstanding,
        "default_deadline_s": 10.0,
        "min_piece_s": min(1.0, args.max_piece_ms) / 1e3,  # the service default, or less under a smaller max
        "max_piece_s": args.max_piece_ms / 1e3,
        "switch_interval_s": args.switch_interval_ms / 1e3,
    }
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(role, job, store.port, cpu_for(i), steps, step_seen, results, stop, options),
            daemon=True,
        )
        for i, role in enumerate(roles)
    ]
    try:
        for p in procs:
            p.start()
        endpoints: dict[int, str] = {}
        while len(endpoints) < 2:
            kind, stage, value = results.get(timeout=120)
            if kind == "error":
                raise RuntimeError(f"stage {stage} failed:\n{value}")
            endpoints[stage] = value
        started = time.monotonic()
        training_done, client_out = ctx.Event(), ctx.Queue()
        client = ctx.Process(
            target=_client_main,
            args=(
                client_out,
                [endpoints[0], endpoints[1]],
                step_seen,
                warmup,
                phase,
                args.outstanding,
                training_done,
                10.0,
                args.prompt_tokens,
            ),
            daemon=True,
        )
        client.start()
        procs.append(client)
        messages, finished = [], 0
        while finished < 2:
            msg = results.get(timeout=300)
            messages.append(msg)
            finished += msg[0] in ("metrics", "error")
            if msg[0] == "error":
                raise RuntimeError(f"stage {msg[1]} failed:\n{msg[2]}")
        training_done.set()
        load = client_out.get(timeout=120)
        if "error" in load:
            raise RuntimeError(f"client failed:\n{load['error']}")
        wall = time.monotonic() - started
    finally:
        stop.set()
        join_or_kill(procs, 30)
        router.close()
    steps_by_stage: dict[int, list[dict]] = {0: [], 1: []}
    metrics: dict[int, dict] = {}
    for kind, stage, value in messages:
        if kind == "step":
            steps_by_stage[stage].append(value)
        elif kind == "metrics":
            metrics[stage] = value
    return summarise(steps_by_stage, metrics, load, phase_of, wall, args)


def summarise(
    steps_by_stage: dict[int, list[dict]],
    metrics: dict[int, dict],
    load: dict,
    phase_of: Any,
    wall: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The JSON figures from the per-step reports and the client's answers."""
    from agents.prefill.metrics import percentile

    busy: dict[str, list[float]] = {"off": [], "on": []}
    split: dict[str, dict[str, list[float]]] = {
        name: {"training": [], "prefill": [], "comm": [], "idle": []} for name in ("off", "on")
    }
    iteration: dict[str, list[float]] = {"off": [], "on": []}
    on_tokens, on_wall = 0, 0.0
    for stage, reports in steps_by_stage.items():
        previous_tokens = 0
        for r in reports:
            name = phase_of(r["step"])
            if name is not None:
                busy[name].append((r["busy_s"] + r["prefill_s"]) / r["iteration_s"])
                shares = {"training": r["busy_s"], "prefill": r["prefill_s"], "comm": r["comm_s"]}
                shares["idle"] = r["iteration_s"] - sum(shares.values())  # receives that waited, minus prefill
                for key, seconds in shares.items():
                    split[name][key].append(seconds / r["iteration_s"])
                if stage == 1:
                    iteration[name].append(r["iteration_s"])
                if name == "on":
                    on_tokens += r["tokens"] - previous_tokens
                    on_wall += r["iteration_s"] / 2  # both stages run the same steps side by side
            previous_tokens = r["tokens"]
    statuses = list(load["statuses"].values())
    ttft = load["ttft_s"]
    p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
    slowdown = statistics.median(iteration["on"]) / statistics.median(iteration["off"])
    return {
        "busy_without_prefill": statistics.mean(busy["off"]),
        "busy_with_prefill": statistics.mean(busy["on"]),
        "training_slowdown": slowdown,
        "prefill_tokens_per_s": on_tokens / on_wall if on_wall else 0.0,
        "ttft_p50_ms": None if p50 is None else p50 * 1e3,
        "ttft_p99_ms": None if p99 is None else p99 * 1e3,
        "requests_lost": load["sent"] - len(statuses),
        "requests_sent": load["sent"],
        "requests_ok": statuses.count("ok"),
        "requests_rejected": statuses.count("rejected"),
        "requests_expired": statuses.count("expired"),
        "iteration_ms_without": statistics.median(iteration["off"]) * 1e3,
        "iteration_ms_with": statistics.median(iteration["on"]) * 1e3,
        "steps_measured": {k: len(v) for k, v in iteration.items()},
        "time_split": {
            ("with_prefill" if name == "on" else "without_prefill"): {
                key: statistics.mean(v) for key, v in parts.items()
            }
            for name, parts in split.items()
        },
        "max_piece_ms": args.max_piece_ms,
        "switch_interval_ms": args.switch_interval_ms,
        "rtt_ms": args.rtt_ms,
        "link_mbit": args.link_mbit,
        "outstanding": args.outstanding,
        "prompt_tokens": args.prompt_tokens,
        "seq_len": args.seq_len,
        "sec_per_token": {s: m.get("sec_per_token") for s, m in metrics.items()},
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the figures and the targets (and, with --json, one JSON object last)."""
    parser = benchmark_parser(__doc__, "short phases (under a minute)")
    parser.add_argument("--rtt-ms", type=in_range(0, 1e4), default=30.0, help="emulated WAN round trip (default 30)")
    parser.add_argument("--link-mbit", type=in_range(1, 1e5), default=200.0, help="emulated WAN link cap (default 200)")
    parser.add_argument(
        "--layers", type=in_range(2, 64, whole=True), default=4, help="model layers, split over 2 stages (default 4)"
    )
    parser.add_argument(
        "--hidden",
        type=in_range(HEADS, 4096, whole=True),
        default=128,
        help=f"model hidden size, a multiple of its {HEADS} heads (default 128)",
    )
    parser.add_argument(
        "--microbatches", type=in_range(1, 64, whole=True), default=4, help="microbatches per step (default 4)"
    )
    parser.add_argument(
        "--warmup-steps", type=in_range(0, 1000, whole=True), default=4, help="steps left out at the start (default 4)"
    )
    parser.add_argument("--phase-steps", type=positive_int, default=15, help="steps per phase (default 15)")
    parser.add_argument("--phases", type=positive_int, default=3, help="pairs of (without, with) phases (default 3)")
    parser.add_argument(
        "--outstanding", type=in_range(1, 256, whole=True), default=6, help="prompts in flight per stage under load"
    )
    parser.add_argument(
        "--seq-len", type=positive_int, default=SEQ_LEN, help=f"the model's sequence length (default {SEQ_LEN})"
    )
    parser.add_argument(
        "--prompt-tokens", type=positive_int, default=PROMPT_TOKENS, help=f"tokens per prompt (default {PROMPT_TOKENS})"
    )
    parser.add_argument(
        "--max-piece-ms",
        type=positive_float,
        default=2.0,
        help="longest piece (half a block) of a prefill chunk: the most training waits for its core (default 2 ms)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=positive_float,
        default=0.5,
        help="Python GIL switch interval in the stage processes (default 0.5 ms; Python's is 5)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.phase_steps, args.phases, args.warmup_steps = 8, 2, 3
    if args.phase_steps < 3:
        parser.error(f"--phase-steps must be >= 3 (got {args.phase_steps})")
    if args.hidden % HEADS:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of the model's {HEADS} heads")
    if args.prompt_tokens > args.seq_len:
        parser.error(f"--prompt-tokens ({args.prompt_tokens}) must be at most --seq-len ({args.seq_len})")
    result = run(args)
    print(
        f"busy fraction without prefill {result['busy_without_prefill']:.3f}, with prefill "
        f"{result['busy_with_prefill']:.3f} (target >= 0.94)"
    )
    for name, parts in result["time_split"].items():
        print(f"time {name.replace('_', ' ')}: " + ", ".join(f"{k} {v:.1%}" for k, v in parts.items()))
    print(
        f"training slowdown (median iteration with / without) {result['training_slowdown']:.3f} "
        f"(target <= 1.02): {result['iteration_ms_with']:.1f} ms vs {result['iteration_ms_without']:.1f} ms"
    )
    ms = {k: "n/a" if result[k] is None else f"{result[k]:.0f} ms" for k in ("ttft_p50_ms", "ttft_p99_ms")}
    print(
        f"prefill {result['prefill_tokens_per_s']:.0f} tokens/s, TTFT p50 {ms['ttft_p50_ms']}, "
        f"p99 {ms['ttft_p99_ms']}; requests sent {result['requests_sent']}, ok {result['requests_ok']}, "
        f"rejected {result['requests_rejected']}, expired {result['requests_expired']}, "
        f"lost {result['requests_lost']}"
    )
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
