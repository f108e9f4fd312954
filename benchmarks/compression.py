"""WAN compression (issue 18): the bytes, the time and the learning a codec on the WAN links changes.

``--codec`` (int8, the default, or fp8) is the codec of the keys:

(a) A WAN-bound rehearsal: ``geosched launch`` of the demo model planned by hand
    one stage per DC (us -> eu -> ap, 2 blocks each), its two WAN links emulated
    at ``--wan-scale`` (default launch's 0.05: the demo's 0.2 Gb/s links become
    10 Mb/s, delays kept; an activation takes 26 ms of link, its forward 4 ms),
    once with ``job.wan_compression: none`` and once with the codec (the same
    layout; the planner compresses both links), rounds alternating the order.
    Both predictions use one calibration measured here first (the launch's
    own, plus the codec's cost, :mod:`agents.rehearsal.codec_profile`;
    ``--quick``: none, the config's FLOP rates).
    ``wan_bytes_ratio``: the bytes the relays carried, codec / none (goal <= 0.55;
    fp32 activations: (64 + 4) / 256 = 0.27); ``iteration_ratio_wan_bound``:
    the measured iteration times, codec / none (goal <= 0.7); and each run's
    measured / predicted.
(b) What is learned: the demo model cut as that plan (3 stages of 2 blocks)
    trained ``--loss-steps`` steps (200) in one process, as is and with every
    tensor crossing a stage boundary, per microbatch, encoded and decoded as
    the transports do (:class:`agents.wan.compress.TensorCodec`: the
    activation forward, its gradient back); L is the trained model's loss on 8
    held-out batches (one training step's loss is one batch's, too noisy).
    **Over ``--seeds`` seeds** (8; the job's seed and the next ones, each the
    model's initialisation and the data's order, trained as is and with each
    codec on the same batches): ``loss_rel_diff_after_200_steps`` is
    |mean L codec - mean L none| / mean L none (goal <= 0.01). Not one seed's
    figure, because that is chaos: this model sits on a plateau (loss 3.19)
    for a number of steps that any perturbation of the boundary tensors moves,
    so the held-out loss at step 200 of one seed moves by a few % whatever
    the perturbation, a 1e-6 jitter included (benchmarks/README.md has the
    figures). ``loss_rel_diff_se`` is the standard error of that mean
    difference (of the seeds' paired differences), the figure's resolution;
    ``loss_noise_floor`` the same figure for a training whose boundary tensors
    are perturbed by 1e-6 of themselves ("jitter", a codec that changes
    nothing systematically); ``loss_rel_diff_by_seed`` each seed's signed
    (L codec - L none) / L none and ``loss_seed_spread`` the spread of none's
    held-out loss over the seeds (standard deviation / mean). Except with
    ``--quick`` also the other codec and the noise floor. Chaos-free beside it, ``grad_rel_error``:
    along the uncompressed training of the job's seed, at 5 steps, how far the
    codec moves the weight gradient of the step's batch, ``|g codec - g| / |g|``
    (the largest), against ``grad_batch_noise``, how far the next batch moves
    it at the same weights (the smallest). The trainings run one process per
    CPU, each one thread (the figures do not depend on it).
(c) The planner: ``configs/gpt3-3dc.yaml`` with ``job.wan_compression`` the codec,
    ``planner.planning.make_plan``'s predicted iteration
    (``gpt3_3dc_iteration_s_with_compression``; the uncompressed plan's too,
    except with ``--quick``).

    python benchmarks/compression.py --quick   # 3 steps a rehearsal, uncalibrated; 2 seeds x 20 learning steps; no gpt3
    python benchmarks/compression.py --json    # last line: one JSON object

JSON keys: ``codec``, ``wan_bytes_ratio``, ``loss_rel_diff_after_200_steps`` (None unless the learning ran
200 steps; ``loss_rel_diff``, ``loss_steps`` and ``loss_seeds`` are what ran), ``loss_rel_diff_se``,
``loss_noise_floor``, ``iteration_ratio_wan_bound``, ``gpt3_3dc_iteration_s_with_compression`` (None with
``--quick``), ``gpt3_3dc_iteration_s_without_compression``, ``loss_rel_diff_by_codec`` and
``loss_rel_diff_se_by_codec`` ({codec, other, jitter}), ``loss_rel_diff_by_seed`` ({codec: [per seed]}),
``loss_seed_spread``, ``held_out_loss`` ({none, ...}: means over the seeds), ``held_out_loss_by_seed``,
``train_loss_last_step`` (means), ``train_loss_rel_diff_last_step``, ``train_loss_rel_diff_mean_last_20``,
``grad_rel_error`` ({codec, other}), ``grad_batch_noise``, ``measured_vs_predicted``, ``iteration_s``,
``wan_bytes`` ({none, codec}), ``codec_s_per_byte``, ``wan_scale``, ``steps``, ``rounds``.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import yaml
from common import benchmark_parser, emit, in_range, positive_int

from agents.layout import layout_plan_text, parse_layout
from agents.rehearsal.calibrate import calibrate_plan
from agents.rehearsal.codec_profile import measure_codec
from agents.rehearsal.launch import DEFAULT_WAN_SCALE, launch
from agents.wan.compress import TensorCodec
from geosched.config import Config, JobSpec, config_from_dict
from geosched.data import TextDataset, default_corpus_paths
from geosched.model import PRECISION_DTYPES, build_stage
from geosched.processes import allowed_cpus

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo-3dc.yaml"
GPT3 = ROOT / "configs" / "gpt3-3dc.yaml"
STAGE_DCS = ["us", "eu", "ap"]
CUTS = [(0, 2), (2, 4), (4, 6)]
HELD_OUT_FROM = 1_000_000  # the held-out batches' steps: never trained on
HELD_OUT_STEPS = 8
LAST_STEPS = 20  # the training losses averaged for the second figure


def with_compression(path: Path, codec: str) -> dict[str, Any]:
    """The config at ``path`` as a dict, with ``job.wan_compression: codec``."""
    data = copy.deepcopy(yaml.safe_load(path.read_text()))
    data["job"]["wan_compression"] = codec
    return dict(data)


# ---------------------------------------------------------------------------- (a) the rehearsal


def rehearse(folder: Path, codec: str, steps: int, wan_scale: float, rounds: int, calibrated: bool) -> dict[str, Any]:
    """(a): the demo, one stage per DC, none and ``codec`` alternately; bytes, iteration times, predictions
    (``calibrated``: from one calibration measured here, else from the config's FLOP rates)."""
    plans: dict[str, Path] = {}
    configs: dict[str, Path] = {}
    for name in ("none", codec):
        data = with_compression(DEMO, name)
        configs[name] = folder / f"demo-{name}.yaml"
        configs[name].write_text(yaml.safe_dump(data, sort_keys=False))
        plans[name] = folder / f"plan-{name}.yaml"
        plans[name].write_text(layout_plan_text(config_from_dict(data), STAGE_DCS, stage_layers=CUTS))
    layout = parse_layout(plans[codec].read_text())
    assert layout.compression == {("eu", "us"): codec, ("ap", "eu"): codec}, layout.compression
    started = time.monotonic()
    codec_cost = measure_codec(layout.job)["codec_s_per_byte"]
    cal = None
    if calibrated:
        cal = dataclasses.replace(calibrate_plan(layout, wan_scale), codec_s_per_byte=codec_cost)  # launch's, once
    print(f"calibration: {time.monotonic() - started:.1f} s, codec {codec_cost:.3g} s/byte", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"none": [], codec: []}
    for r in range(rounds):
        for name in ("none", codec) if r % 2 == 0 else (codec, "none"):
            report = launch(
                str(configs[name]),
                plan_path=str(plans[name]),
                steps=steps,
                run_dir=folder / f"r{r}-{name}",
                wan_scale=wan_scale,
                calibration=cal,
                out=None,
            )
            runs[name].append(report)
            print(
                f"round {r}: {name:<4} {report['measured_iteration_s'] * 1e3:7.1f} ms/iteration (predicted "
                f"{report['predicted_iteration_s'] * 1e3:.1f}), WAN {sum(report['wan_bytes'].values()) / 1e6:.3f} MB, "
                f"loss {report['losses'][-1]:.4f}",
                flush=True,
            )
    iteration = {c: statistics.median(r["measured_iteration_s"] for r in runs[c]) for c in runs}
    wan = {c: statistics.median(sum(r["wan_bytes"].values()) for r in runs[c]) for c in runs}
    return {
        "wan_bytes_ratio": wan[codec] / wan["none"],
        "iteration_ratio_wan_bound": iteration[codec] / iteration["none"],
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


class Jitter:
    """Not a codec: every value times (1 + 1e-6 x a seeded normal), to measure how far two trainings part
    that differ by next to nothing (the learning comparison's noise floor)."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 1e-6 * torch.randn(x.shape, generator=self.generator, dtype=x.dtype))

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return x


def boundary_link(job: JobSpec, codec: str) -> Any:
    """What each boundary tensor goes through: None ("none": as is), :class:`Jitter` or the codec's
    :class:`TensorCodec` for the stage boundary's tensor."""
    if codec == "none":
        return None
    if codec == "jitter":
        return Jitter()
    shape = (job.batch, job.model.seq_len, job.model.hidden)
    return TensorCodec(codec, PRECISION_DTYPES[job.precision], shape)  # type: ignore[arg-type]


def cut_model(job: JobSpec) -> list[Any]:
    """The demo model cut at :data:`CUTS`, initialised from ``job.seed``."""
    return [
        build_stage(job.model, a, b, first=i == 0, last=i == len(CUTS) - 1, seed=job.seed)
        for i, (a, b) in enumerate(CUTS)
    ]


def accumulate(stages: list[Any], dataset: TextDataset, job: JobSpec, step: int, link: Any) -> float:
    """One step's microbatches as the runtime runs them, (loss / m).backward() each, every boundary tensor
    through ``link``; the step's loss (the gradients are left in the parameters)."""
    m, total = job.global_batch // job.batch, 0.0
    for inputs, targets in dataset.batch(step, 0, 1, job.batch, m):
        h = inputs
        for stage in stages[:-1]:
            h = stage(h)  # (b, T, C)
            h = Boundary.apply(h, link) if link is not None else h
        loss = stages[-1].loss(stages[-1](h), targets)
        (loss / m).backward()
        total += float(loss.detach()) / m
    return total


def train_cut(job: JobSpec, dataset: TextDataset, steps: int, codec: str) -> tuple[list[float], float]:
    """The losses of ``steps`` steps (:func:`accumulate`, then one AdamW step) of the model cut at
    :data:`CUTS`, each boundary tensor through ``codec`` (:func:`boundary_link`); and the trained
    model's :func:`held_out_loss`."""
    stages = cut_model(job)
    optimizer = torch.optim.AdamW([p for stage in stages for p in stage.parameters()], lr=job.learning_rate)
    link, losses = boundary_link(job, codec), []
    for step in range(steps):
        losses.append(accumulate(stages, dataset, job, step, link))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, held_out_loss(stages, dataset, job)


def held_out_loss(stages: list[Any], dataset: TextDataset, job: JobSpec) -> float:
    """What the model learned: its mean loss, uncompressed, on :data:`HELD_OUT_STEPS` batches of steps far
    beyond any trained (the same batches for every codec). One training step's loss is one batch's, whose
    noise (+-0.2 here) swamps the codec's effect."""
    total, count = 0.0, 0
    with torch.no_grad():
        for step in range(HELD_OUT_FROM, HELD_OUT_FROM + HELD_OUT_STEPS):
            for inputs, targets in dataset.batch(step, 0, 1, job.batch, job.global_batch // job.batch):
                h = inputs
                for stage in stages:
                    h = stage(h)
                total += float(stages[-1].loss(h, targets))
                count += 1
    return total / count


def seeded(job: JobSpec, seed: int) -> tuple[JobSpec, TextDataset]:
    """The job with ``seed`` (the model's initialisation) and the corpus sampled from ``seed`` too."""
    job = dataclasses.replace(job, seed=seed)
    return job, TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=seed)


def train_task(job: JobSpec, steps: int, codec: str) -> dict[str, float]:
    """One training of :func:`learning` (a pool task): held-out loss, last step's, mean of the last 20."""
    torch.set_num_threads(1)
    job, dataset = seeded(job, job.seed)
    losses, held = train_cut(job, dataset, steps, codec)
    return {"held": held, "last": losses[-1], "tail": statistics.fmean(losses[-LAST_STEPS:])}


def gradient_error(job: JobSpec, steps: int, codecs: tuple[str, ...]) -> dict[str, Any]:
    """Chaos-free: along the uncompressed training, at 5 steps, the weight gradient of the step's batch
    with each codec on every boundary against the exact one (``|g codec - g| / |g|``, the largest of the
    5), beside how far the next step's batch moves it at the same weights (the smallest of the 5)."""
    torch.set_num_threads(1)
    job, dataset = seeded(job, job.seed)
    stages = cut_model(job)
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = torch.optim.AdamW(params, lr=job.learning_rate)

    def grad(step: int, link: Any) -> torch.Tensor:
        accumulate(stages, dataset, job, step, link)
        out = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])  # (P,)
        optimizer.zero_grad(set_to_none=True)
        return out

    checks = {0, steps // 4, steps // 2, 3 * steps // 4, steps - 1}
    errors: dict[str, list[float]] = {c: [] for c in codecs}
    noise = []
    for step in range(steps):
        if step in checks:
            exact = grad(step, None)
            noise.append(float((grad(step + 1, None) - exact).norm() / exact.norm()))
            for codec in codecs:
                errors[codec].append(float((grad(step, boundary_link(job, codec)) - exact).norm() / exact.norm()))
        accumulate(stages, dataset, job, step, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"grad_rel_error": {c: max(e) for c, e in errors.items()}, "grad_batch_noise": min(noise)}


def learning(job: JobSpec, steps: int, codecs: tuple[str, ...], seeds: int) -> dict[str, Any]:
    """(b): what each codec changes in what is learned. Each of ``seeds`` seeds (the job's and the next
    ones: initialisation and data) trains as is and with each codec; the key is the difference of the
    mean held-out losses over the seeds, relative to none's (the first codec's; "jitter" gives the noise
    floor), beside each seed's, the standard error of the mean difference, and :func:`gradient_error`.
    The trainings run in parallel, one process per CPU (each one thread, as deterministic as alone)."""
    variants = ("none", *codecs)
    runs = [(codec, job.seed + i) for codec in variants for i in range(seeds)]
    started = time.monotonic()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max(1, min(len(allowed_cpus()), len(runs) + 1)), mp_context=context) as pool:
        futures = [pool.submit(train_task, dataclasses.replace(job, seed=s), steps, c) for c, s in runs]
        fidelity = pool.submit(gradient_error, job, steps, tuple(c for c in codecs if c != "jitter"))
        got = {run: f.result() for run, f in zip(runs, futures)}
        result: dict[str, Any] = fidelity.result()
    by_seed = {c: [got[c, job.seed + i] for i in range(seeds)] for c in variants}
    held = {c: [r["held"] for r in by_seed[c]] for c in variants}
    mean = {c: statistics.fmean(held[c]) for c in variants}
    for codec in variants:
        print(
            f"learning {codec:<6}: held-out loss after {steps} steps, mean of {seeds} seeds {mean[codec]:.4f} "
            f"(each {' '.join(f'{h:.3f}' for h in held[codec])})",
            flush=True,
        )
    print(f"learning: {len(runs)} trainings and the gradient check in {time.monotonic() - started:.1f} s", flush=True)

    def rel(key: str, codec: str) -> float:
        values = {c: statistics.fmean(r[key] for r in by_seed[c]) for c in ("none", codec)}
        return abs(values[codec] - values["none"]) / values["none"]

    def se(codec: str) -> float | None:
        diffs = [c - n for c, n in zip(held[codec], held["none"])]
        return statistics.stdev(diffs) / seeds**0.5 / mean["none"] if seeds > 1 else None

    key = rel("held", codecs[0])
    result.update(
        {
            "loss_rel_diff_after_200_steps": key if steps == 200 else None,
            "loss_rel_diff": key,
            "loss_rel_diff_se": se(codecs[0]),
            "loss_noise_floor": rel("held", "jitter") if "jitter" in codecs else None,
            "loss_steps": steps,
            "loss_seeds": seeds,
            "loss_rel_diff_by_codec": {c: rel("held", c) for c in codecs},
            "loss_rel_diff_se_by_codec": {c: se(c) for c in codecs},
            "loss_rel_diff_by_seed": {c: [(x - n) / n for x, n in zip(held[c], held["none"])] for c in codecs},
            "loss_seed_spread": statistics.stdev(held["none"]) / mean["none"] if seeds > 1 else None,
            "held_out_loss": mean,
            "held_out_loss_by_seed": held,
            "train_loss_last_step": {c: statistics.fmean(r["last"] for r in by_seed[c]) for c in variants},
            "train_loss_rel_diff_last_step": {c: rel("last", c) for c in codecs},
            f"train_loss_rel_diff_mean_last_{LAST_STEPS}": {c: rel("tail", c) for c in codecs},
        }
    )
    return result


# ---------------------------------------------------------------------------- (c) the planner


def gpt3(codecs: tuple[str, ...]) -> dict[str, Any]:  # the first compresses
    """(c): the planner's predicted iteration of gpt3-3dc with each codec."""
    from planner.planning import make_plan

    out: dict[str, Any] = {}
    for codec in codecs:
        started = time.monotonic()
        config: Config = config_from_dict(with_compression(GPT3, codec))
        plan = make_plan(config).plan
        compressed = sum(link.compression != "none" for link in plan.links)
        name = "without" if codec == "none" else "with"
        out[f"gpt3_3dc_iteration_s_{name}_compression"] = plan.prediction.iteration_s
        print(
            f"gpt3-3dc {codec:<4}: {plan.prediction.iteration_s:.3f} s per iteration, {len(plan.links)} WAN links "
            f"({compressed} compressed), planned in {time.monotonic() - started:.1f} s",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """(a), (b), (c); print each line and, with --json, one object."""
    parser = benchmark_parser(
        __doc__, "3 steps a rehearsal, uncalibrated; 2 seeds x 20 learning steps; no gpt3 (under a minute)"
    )
    parser.add_argument("--steps", type=positive_int, help="training steps per rehearsal (default 10; --quick 3)")
    parser.add_argument(
        "--rounds", type=positive_int, help="uncompressed+compressed rehearsal pairs (default 2; --quick 1)"
    )
    parser.add_argument("--codec", choices=("int8", "fp8"), default="int8", help="the codec of the keys (int8)")
    parser.add_argument(
        "--wan-scale",
        type=in_range(1e-3, 1e3),
        default=DEFAULT_WAN_SCALE,
        help=f"emulated WAN bandwidth x this ({DEFAULT_WAN_SCALE})",
    )
    parser.add_argument(
        "--loss-steps", type=positive_int, help="steps of the learning comparison (default 200; --quick 20)"
    )
    parser.add_argument(
        "--seeds", type=positive_int, help="training seeds of the learning comparison (default 8; --quick 2)"
    )
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 10)
    rounds = args.rounds or (1 if args.quick else 2)
    loss_steps = args.loss_steps or (20 if args.quick else 200)
    seeds = args.seeds or (2 if args.quick else 8)
    torch.set_num_threads(1)  # as every rank runs; the learning comparison too
    codec, other = args.codec, {"int8": "fp8", "fp8": "int8"}[args.codec]
    job = config_from_dict(with_compression(DEMO, codec)).job
    result: dict[str, Any] = {"codec": codec}
    result.update(learning(job, loss_steps, (codec,) if args.quick else (codec, other, "jitter"), seeds))
    with tempfile.TemporaryDirectory(prefix="geosched-compression-") as tmp:
        result.update(rehearse(Path(tmp), codec, steps, args.wan_scale, rounds, calibrated=not args.quick))
    result.update(gpt3(() if args.quick else (codec, "none")))
    result.setdefault("gpt3_3dc_iteration_s_with_compression", None)
    result.update({"wan_scale": args.wan_scale, "steps": steps, "rounds": rounds})
    spread = f"mean of {seeds} seeds"
    if result["loss_rel_diff_se"] is not None:
        spread += f", standard error {result['loss_rel_diff_se']:.1e}"
    if result["loss_noise_floor"] is not None:
        spread += f", noise floor {result['loss_noise_floor']:.1e}"
    print(
        f"{codec}: WAN bytes / none {result['wan_bytes_ratio']:.3f} (goal <= 0.55), iteration / none "
        f"{result['iteration_ratio_wan_bound']:.3f} (goal <= 0.7), held-out loss rel diff after {loss_steps} steps "
        f"{result['loss_rel_diff']:.2e} (goal <= 0.01; {spread}), "
        f"measured/predicted none {result['measured_vs_predicted']['none']:.2f}, {codec} "
        f"{result['measured_vs_predicted'][codec]:.2f}"
    )
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
