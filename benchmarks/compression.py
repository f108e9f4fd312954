"""WAN compression (issue 18): the bytes, the time and the learning fp8 on the WAN links changes.

(a) A WAN-bound rehearsal: ``geosched launch`` of the demo model planned by hand
    one stage per DC (us -> eu -> ap, 2 blocks each), its two WAN links emulated
    at ``--wan-scale`` (default launch's 0.05: the demo's 0.2 Gb/s links become
    10 Mb/s, delays kept; an activation takes 26 ms of link, its forward 4 ms),
    once with ``job.wan_compression: none`` and once with ``fp8`` (the same
    layout; the planner compresses both links), rounds alternating the order.
    Both predictions use one calibration measured here first (the launch's
    own, plus the codec's cost, :mod:`agents.rehearsal.codec_profile`;
    ``--quick``: none, the config's FLOP rates).
    ``wan_bytes_ratio``: the bytes the relays carried, fp8 / none (goal <= 0.55;
    fp32 activations: (128 + 4) / 512 = 0.26); ``iteration_ratio_wan_bound``:
    the measured iteration times, fp8 / none (goal <= 0.7); and each run's
    measured / predicted.
(b) What is learned: the demo model cut as that plan (3 stages of 2 blocks)
    trained ``--loss-steps`` steps (200) in one process, twice, on the same
    batches from the same seed: once as is, once with every tensor crossing a
    stage boundary, per microbatch, encoded and decoded as the transports do
    (:class:`agents.wan.compress.TensorCodec`: the activation forward, its
    gradient back). ``loss_rel_diff_after_200_steps``: |final loss fp8 - final
    loss none| / final loss none (goal <= 0.01); int8 too, except with ``--quick``.
(c) The planner: ``configs/gpt3-3dc.yaml`` with ``job.wan_compression: fp8``,
    ``planner.planning.make_plan``'s predicted iteration
    (``gpt3_3dc_iteration_s_with_compression``; the uncompressed plan's too,
    except with ``--quick``).

    python benchmarks/compression.py --quick       # 3 steps a rehearsal, uncalibrated; 40 learning steps; no gpt3
    python benchmarks/compression.py --json        # last line: one JSON object

JSON keys: ``wan_bytes_ratio``, ``loss_rel_diff_after_200_steps`` (None unless the learning ran 200 steps;
``loss_rel_diff`` and ``loss_steps`` are what ran), ``iteration_ratio_wan_bound``,
``gpt3_3dc_iteration_s_with_compression`` (None with ``--quick``), ``gpt3_3dc_iteration_s_without_compression``,
``loss_rel_diff_int8``, ``losses_final`` ({none, fp8, int8}), ``measured_vs_predicted`` ({none, fp8}),
``iteration_s`` ({none, fp8}), ``wan_bytes`` ({none, fp8}), ``codec_s_per_byte``, ``wan_scale``, ``steps``,
``rounds``.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from common import benchmark_parser, emit

from agents.layout import layout_plan_text, parse_layout
from agents.rehearsal.codec_profile import measure_codec
from agents.rehearsal.launch import DEFAULT_WAN_SCALE, calibrate, launch
from agents.wan.compress import TensorCodec
from geosched.config import Config, JobSpec, config_from_dict
from geosched.data import TextDataset, default_corpus_paths
from geosched.model import PRECISION_DTYPES, build_stage

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo-3dc.yaml"
GPT3 = ROOT / "configs" / "gpt3-3dc.yaml"
STAGE_DCS = ["us", "eu", "ap"]
CUTS = [(0, 2), (2, 4), (4, 6)]


def with_compression(path: Path, codec: str) -> dict[str, Any]:
    """The config at ``path`` as a dict, with ``job.wan_compression: codec``."""
    data = copy.deepcopy(yaml.safe_load(path.read_text()))
    data["job"]["wan_compression"] = codec
    return dict(data)


# ---------------------------------------------------------------------------- (a) the rehearsal


def rehearse(folder: Path, steps: int, wan_scale: float, rounds: int, calibrated: bool) -> dict[str, Any]:
    """(a): the demo, one stage per DC, none and fp8 alternately; bytes, iteration times, predictions
    (``calibrated``: from one calibration measured here, else from the config's FLOP rates)."""
    plans: dict[str, Path] = {}
    configs: dict[str, Path] = {}
    for codec in ("none", "fp8"):
        data = with_compression(DEMO, codec)
        configs[codec] = folder / f"demo-{codec}.yaml"
        configs[codec].write_text(yaml.safe_dump(data, sort_keys=False))
        plans[codec] = folder / f"plan-{codec}.yaml"
        plans[codec].write_text(layout_plan_text(config_from_dict(data), STAGE_DCS, stage_layers=CUTS))
    layout = parse_layout(plans["fp8"].read_text())
    assert layout.compression == {("eu", "us"): "fp8", ("ap", "eu"): "fp8"}, layout.compression
    started = time.monotonic()
    codec_cost = measure_codec(layout.job)["codec_s_per_byte"]
    cal = None
    if calibrated:
        cal = dataclasses.replace(calibrate(layout, wan_scale), codec_s_per_byte=codec_cost)  # launch's, once
    print(f"calibration: {time.monotonic() - started:.1f} s, codec {codec_cost:.3g} s/byte", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "fp8": []}
    for r in range(rounds):
        for codec in ("none", "fp8") if r % 2 == 0 else ("fp8", "none"):
            report = launch(
                str(configs[codec]),
                plan_path=str(plans[codec]),
                steps=steps,
                run_dir=folder / f"r{r}-{codec}",
                wan_scale=wan_scale,
                calibration=cal,
                out=None,
            )
            runs[codec].append(report)
            print(
                f"round {r}: {codec:<4} {report['measured_iteration_s'] * 1e3:7.1f} ms/iteration (predicted "
                f"{report['predicted_iteration_s'] * 1e3:.1f}), WAN {sum(report['wan_bytes'].values()) / 1e6:.3f} MB, "
                f"loss {report['losses'][-1]:.4f}",
                flush=True,
            )
    iteration = {c: statistics.median(r["measured_iteration_s"] for r in runs[c]) for c in runs}
    wan = {c: statistics.median(sum(r["wan_bytes"].values()) for r in runs[c]) for c in runs}
    return {
        "wan_bytes_ratio": wan["fp8"] / wan["none"],
        "iteration_ratio_wan_bound": iteration["fp8"] / iteration["none"],
        "iteration_s": iteration,
        "wan_bytes": wan,
        "measured_vs_predicted": {c: statistics.median(r["measured_vs_predicted"] for r in runs[c]) for c in runs},
        "codec_s_per_byte": codec_cost,
    }


# ---------------------------------------------------------------------------- (b) what is learned


class Boundary(torch.autograd.Function):
    """A stage boundary as a compressed link carries it: the activation encoded and decoded on the way
    forward, its gradient on the way back (what the two transports do with each message)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codec: TensorCodec) -> torch.Tensor:
        ctx.codec = codec
        return codec.decode(codec.encode(x.detach()))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.codec.decode(ctx.codec.encode(grad.contiguous())), None


def train_cut(job: JobSpec, dataset: TextDataset, steps: int, codec: str) -> list[float]:
    """The losses of ``steps`` steps of the model cut at :data:`CUTS`, microbatch by microbatch as the
    runtime runs them ((loss / m).backward() each, then one AdamW step), each boundary tensor through
    ``codec`` ("none": as is)."""
    stages = [
        build_stage(job.model, a, b, first=i == 0, last=i == len(CUTS) - 1, seed=job.seed)
        for i, (a, b) in enumerate(CUTS)
    ]
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = torch.optim.AdamW(params, lr=job.learning_rate)
    m = job.global_batch // job.batch
    shape = (job.batch, job.model.seq_len, job.model.hidden)
    link = None if codec == "none" else TensorCodec(codec, PRECISION_DTYPES[job.precision], shape)  # type: ignore[arg-type]
    losses = []
    for step in range(steps):
        total = 0.0
        for inputs, targets in dataset.batch(step, 0, 1, job.batch, m):
            h = inputs
            for stage in stages[:-1]:
                h = stage(h)  # (b, T, C)
                h = Boundary.apply(h, link) if link is not None else h
            loss = stages[-1].loss(stages[-1](h), targets)
            (loss / m).backward()
            total += float(loss.detach()) / m
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def learning(job: JobSpec, steps: int, codecs: tuple[str, ...]) -> dict[str, Any]:
    """(b): the final loss with each codec against none."""
    dataset = TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed)
    finals = {}
    for codec in ("none", *codecs):
        started = time.monotonic()
        losses = train_cut(job, dataset, steps, codec)
        finals[codec] = losses[-1]
        print(
            f"learning {codec:<4}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} steps "
            f"({time.monotonic() - started:.1f} s)",
            flush=True,
        )
    diff = {c: abs(finals[c] - finals["none"]) / finals["none"] for c in codecs}
    return {
        "loss_rel_diff_after_200_steps": diff["fp8"] if steps == 200 else None,
        "loss_rel_diff": diff["fp8"],
        "loss_steps": steps,
        "loss_rel_diff_int8": diff.get("int8"),
        "losses_final": finals,
    }


# ---------------------------------------------------------------------------- (c) the planner


def gpt3(codecs: tuple[str, ...]) -> dict[str, Any]:
    """(c): the planner's predicted iteration of gpt3-3dc with each codec."""
    from planner.planning import make_plan

    out: dict[str, Any] = {}
    for codec in codecs:
        started = time.monotonic()
        config: Config = config_from_dict(with_compression(GPT3, codec))
        plan = make_plan(config).plan
        compressed = sum(link.compression != "none" for link in plan.links)
        name = "with" if codec == "fp8" else "without"
        out[f"gpt3_3dc_iteration_s_{name}_compression"] = plan.prediction.iteration_s
        print(
            f"gpt3-3dc {codec:<4}: {plan.prediction.iteration_s:.3f} s per iteration, {len(plan.links)} WAN links "
            f"({compressed} compressed), planned in {time.monotonic() - started:.1f} s",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """(a), (b), (c); print each line and, with --json, one object."""
    parser = benchmark_parser(__doc__, "3 steps a rehearsal, uncalibrated; 40 learning steps; no gpt3 (under a minute)")
    parser.add_argument("--steps", type=int, help="training steps per rehearsal (default 10; --quick 3)")
    parser.add_argument("--rounds", type=int, help="none+fp8 rehearsal pairs (default 2; --quick 1)")
    parser.add_argument(
        "--wan-scale",
        type=float,
        default=DEFAULT_WAN_SCALE,
        help=f"emulated WAN bandwidth x this ({DEFAULT_WAN_SCALE})",
    )
    parser.add_argument("--loss-steps", type=int, help="steps of the learning comparison (default 200; --quick 40)")
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 10)
    rounds = args.rounds or (1 if args.quick else 2)
    loss_steps = args.loss_steps or (40 if args.quick else 200)
    torch.set_num_threads(1)  # as every rank runs; the learning comparison too
    job = config_from_dict(with_compression(DEMO, "fp8")).job
    result: dict[str, Any] = {}
    result.update(learning(job, loss_steps, ("fp8",) if args.quick else ("fp8", "int8")))
    with tempfile.TemporaryDirectory(prefix="geosched-compression-") as tmp:
        result.update(rehearse(Path(tmp), steps, args.wan_scale, rounds, calibrated=not args.quick))
    result.update(gpt3(() if args.quick else ("fp8", "none")))
    result.setdefault("gpt3_3dc_iteration_s_with_compression", None)
    result.update({"wan_scale": args.wan_scale, "steps": steps, "rounds": rounds})
    print(
        f"WAN bytes fp8/none {result['wan_bytes_ratio']:.3f} (goal <= 0.55), iteration fp8/none "
        f"{result['iteration_ratio_wan_bound']:.3f} (goal <= 0.7), loss rel diff after {loss_steps} steps "
        f"{result['loss_rel_diff']:.2e} (goal <= 0.01), measured/predicted none "
        f"{result['measured_vs_predicted']['none']:.2f}, fp8 {result['measured_vs_predicted']['fp8']:.2f}"
    )
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
