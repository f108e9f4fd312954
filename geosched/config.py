"""The cluster and job config: typed, strict, loaded from YAML.

A config file has two sections::

    cluster:              # datacenters and the WAN links between them
      name: demo-3dc
      datacenters:
        - {name: us, gpus: 2, gpu: {name: cpu, tflops: 0.02, memory_gib: 4}}
      links:
        - {between: [us, eu], bandwidth_gbps: 1, rtt_ms: 40, per_connection_gbps: 0.125}
    job:                  # the model and how it is trained
      model: {layers: 6, hidden: 64, heads: 4, seq_len: 64}
      global_batch: 16
      microbatch_size: 2

Every error names the dotted field path, the bad value and the remedy; unknown
keys are errors; cross-field checks print the numbers involved. A link not
listed is absent: those two DCs cannot exchange pipeline traffic.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import Literal

from geosched.chunking import MAX_STREAMS
from geosched.errors import ConfigError
from geosched.schedule.builders import MAX_STAGE_MICROBATCHES
from geosched.schema import dump_dataclass, load_dataclass, schema_depth, spec
from geosched.yamlload import YamlLimits, dump_yaml, read_yaml_file

log = logging.getLogger(__name__)
INITIAL_LOSS_SCALE = 65536.0
"""fp16's first dynamic loss scale: torch.amp.GradScaler's and DeepSpeed's default (2^16)."""
LR_MIN_RATIO = 0.1
"""The default end of a decaying learning rate, as a fraction of job.learning_rate."""
MIXED_PRECISION_STATE_BYTES = 12.0
"""AdamW state per bf16/fp16 parameter as the agents keep it (geosched.optim.MasterAdamW): an fp32 master and
two fp32 moments; the default of ``job.optimizer_bytes_per_param``."""


@functools.cache
def _warn_once(message: str) -> None:
    """Log a config warning once per process (configs are validated again wherever they are loaded)."""
    log.warning("%s", message)


MAX_NAME_LEN = 64
"""The longest datacenter, GPU or cluster name."""
MAX_LAYERS = 4096
MAX_STEPS = 10**9
"""The most training steps a job may ask for (job.steps, launch --steps)."""
"""The most transformer blocks a model may have."""
MICROBATCH_SIZES = (1, 2, 4, 8)
"""Microbatch sizes the planner tries when job.microbatch_size is null (those dividing the global batch)."""
MAX_DC_GPUS = 1_000_000
"""The most GPUs one datacenter may offer."""
MAX_DATACENTERS = 256
"""The most datacenters a cluster may have."""
MAX_GPUS_PER_NODE = 64
"""The most GPUs one node (and so one tensor-parallel group) may have."""
SCHEDULES = ("gpipe", "1f1b", "zb1p")
"""Pipeline schedules the planner, simulator and agents know (zb1p: Qi et al. 2023's ZB-H1)."""

Precision = Literal["fp32", "bf16", "fp16"]
ScheduleName = Literal["gpipe", "1f1b", "zb1p"]
BYTES_PER_ELEMENT: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class GpuSpec:
    """One kind of accelerator."""

    name: str = spec("GPU model, e.g. H100", max_len=MAX_NAME_LEN)
    tflops: float = spec("sustained dense TFLOP/s at the job's precision (not the datasheet peak)", ge=1e-3, le=1e6)
    memory_gib: float = spec("device memory in GiB", gt=0, le=1e6)


@dataclass(frozen=True)
class DatacenterSpec:
    """A datacenter: a pool of identical GPUs with a fast internal network."""

    name: str = spec("unique datacenter name, used by links and plans", max_len=MAX_NAME_LEN)
    gpus: int = spec("GPUs available to this job in this datacenter", ge=1, le=MAX_DC_GPUS)
    gpu: GpuSpec = spec("the GPU kind")
    intra_bandwidth_gbps: float = spec(
        "per-GPU network bandwidth inside the DC, Gb/s (all-reduce)", 400.0, ge=1e-3, le=1e6
    )
    intra_latency_us: float = spec("one-hop latency inside the DC, microseconds", 10.0, ge=0, le=1e6)
    gpus_per_node: int = spec(
        "GPUs per node (server); tensor parallelism stays inside one node", 8, ge=1, le=MAX_GPUS_PER_NODE
    )
    node_bandwidth_gbps: float = spec(
        "per-GPU bandwidth between the GPUs of one node, Gb/s (NVLink-class: 2400 = 300 GB/s)", 2400.0, ge=1e-3, le=1e7
    )
    node_latency_us: float = spec("one-hop latency between the GPUs of one node, microseconds", 3.0, ge=0, le=1e6)


@dataclass(frozen=True)
class WanLinkSpec:
    """A WAN link between two datacenters (symmetric, full duplex)."""

    between: tuple[str, str] = spec("the two datacenter names", max_len=MAX_NAME_LEN)
    bandwidth_gbps: float = spec("link capacity per direction, Gb/s", ge=1e-6, le=1e6)
    rtt_ms: float = spec("round-trip time, ms", ge=0, le=1e5)
    per_connection_gbps: float = spec(
        "throughput one TCP connection reaches on this link, Gb/s (its window / RTT)", ge=1e-6, le=1e6
    )
    egress_usd_per_gb: float = spec("price per GB sent over the link, either direction, USD", 0.0, ge=0, le=1e3)
    max_streams: int = spec("most TCP connections a link may open", MAX_STREAMS, ge=1, le=MAX_STREAMS)


@dataclass(frozen=True)
class ClusterSpec:
    """Datacenters and the WAN links that join them."""

    name: str = spec("cluster name", max_len=MAX_NAME_LEN)
    datacenters: tuple[DatacenterSpec, ...] = spec("the datacenters", max_items=MAX_DATACENTERS)
    links: tuple[WanLinkSpec, ...] = spec("WAN links; a pair not listed cannot talk", (), max_items=4096)

    @functools.cached_property
    def _by_name(self) -> dict[str, DatacenterSpec]:
        return {dc.name: dc for dc in self.datacenters}

    @functools.cached_property
    def _by_pair(self) -> dict[frozenset[str], WanLinkSpec]:
        return {frozenset(link.between): link for link in reversed(self.links)}  # the first listed wins

    def dc(self, name: str) -> DatacenterSpec:
        """The datacenter called ``name`` (a dict lookup: the cost model asks for every stage)."""
        found = self._by_name.get(name)
        if found is None:
            raise ConfigError(f"unknown datacenter {name!r}; known: {', '.join(d.name for d in self.datacenters)}")
        return found

    def link(self, a: str, b: str) -> WanLinkSpec | None:
        """The link joining ``a`` and ``b`` (either order), or None."""
        return self._by_pair.get(frozenset((a, b))) if a != b else None

    @property
    def total_gpus(self) -> int:
        """GPUs over all datacenters."""
        return sum(dc.gpus for dc in self.datacenters)


@dataclass(frozen=True)
class CustomLayer:
    """Explicit cost of one layer, for models that are not plain GPT blocks."""

    forward_gflop_per_sample: float = spec("forward GFLOP per sequence", gt=0, le=1e12)
    params: int = spec("parameters", ge=0, le=10**13)
    activation_bytes_per_sample: int = spec(
        "bytes of the layer's output per sequence (sent between stages)", ge=0, le=10**13
    )
    stash_bytes_per_sample: int = spec("bytes kept for the backward pass per sequence", ge=0, le=10**13)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (GPT style), or explicit per-layer costs."""

    layers: int = spec("transformer blocks", ge=1, le=MAX_LAYERS)
    hidden: int = spec("hidden size", ge=1, le=1 << 20)
    heads: int = spec("attention heads", ge=1, le=1 << 16)
    seq_len: int = spec("tokens per sequence", ge=1, le=1 << 24)
    vocab: int = spec("vocabulary size (256 = bytes)", 256, ge=2, le=1 << 24)
    ffn_mult: int = spec("MLP width as a multiple of hidden", 4, ge=1, le=64)
    custom_layers: tuple[CustomLayer, ...] = spec(
        "explicit per-block costs overriding the GPT formulas (one entry per layer)", (), max_items=MAX_LAYERS
    )


@dataclass(frozen=True)
class JobSpec:
    """What is trained and how.

    ``microbatch_size``, ``schedule``, ``tensor_parallel`` and ``zero`` left
    null are the planner's to choose; a value pins them. A plan's embedded
    config has all four set (:meth:`resolved`), and that is what agents run.
    """

    model: ModelSpec = spec("the model")
    global_batch: int = spec("sequences per iteration, over all replicas", ge=1, le=1 << 24)
    microbatch_size: int | None = spec("sequences per microbatch; null: the planner chooses", None, ge=1, le=1 << 24)
    precision: Precision = spec("training precision (bf16, fp16: AdamW steps fp32 master weights)", "bf16")
    grad_dtype: Literal["fp32", "precision"] = spec(
        "bf16/fp16 only: 'fp32' accumulates each parameter's gradient over the microbatches and averages it over "
        "the replicas in fp32 (Megatron's default for bf16; 2 bytes more a parameter and twice the gradient-sync "
        "bytes); 'precision': in the training precision, rounding every microbatch's sum",
        "fp32",
    )
    optimizer_bytes_per_param: float = spec(
        "optimizer state bytes per parameter (Adam, mixed precision: 12)", MIXED_PRECISION_STATE_BYTES, ge=0, le=1024
    )
    initial_loss_scale: float = spec(
        "fp16 only: the dynamic loss scale's first value; halved (and the step skipped) when a gradient "
        "overflows, doubled after 2000 steps without overflow (torch.amp.GradScaler's rule)",
        INITIAL_LOSS_SCALE,
        ge=1,
        le=2.0**64,
    )
    schedule: ScheduleName | None = spec(
        "pipeline schedule (gpipe, 1f1b, zb1p = zero-bubble ZB-H1); null: the planner chooses", None
    )
    tensor_parallel: int | None = spec(
        "tensor-parallel degree inside a node (divides gpus_per_node and heads); null: the planner chooses",
        None,
        ge=1,
        le=MAX_GPUS_PER_NODE,
    )
    zero: int | None = spec(
        "ZeRO stage inside a stage's data-parallel group: 0 none, 1 optimizer state sharded, "
        "2 gradients too; null: the planner chooses",
        None,
        ge=0,
        le=2,
    )
    attention: Literal["flash", "unfused"] = spec(
        "attention kernel for activation memory: 'flash' keeps no s^2 scores (fused attention), "
        "'unfused' keeps them (Korthikanti et al. 2022's 5as/h term)",
        "flash",
    )
    recompute: Literal["none", "full"] = spec(
        "activation recomputation: 'full' keeps only each block's input and reruns its forward during backward "
        "(priced by the planner; the stages run it with `torch.utils.checkpoint`, the same gradients)",
        "none",
    )
    wan_compression: Literal["none", "int8", "fp8"] = spec(
        "lossy compression of activations and their gradients on WAN links, turned on per link where it "
        "shortens the messages: 'int8' or 'fp8' (e4m3), one byte a value and one fp32 scale per 64; "
        "'none': never (geosched.compression)",
        "none",
    )
    steps: int = spec("training iterations", 100, ge=1, le=MAX_STEPS)
    seed: int = spec("seed for initialisation and data order", 0, ge=0, le=2**63 - 1)
    learning_rate: float = spec("AdamW learning rate (the peak, with a warm-up or decay)", 3e-4, gt=0, le=10)
    lr_warmup_steps: int = spec(
        "steps over which the learning rate rises linearly to learning_rate (0: none)", 0, ge=0, le=MAX_STEPS
    )
    lr_decay: Literal["none", "linear", "cosine"] = spec(
        "after the warm-up: 'none' keeps learning_rate; 'linear' or 'cosine' decays it to "
        "lr_min_ratio x learning_rate at the last of job.steps, held after",
        "none",
    )
    lr_min_ratio: float = spec("the decay's end, as a fraction of learning_rate", LR_MIN_RATIO, ge=0, le=1)
    weight_decay: float = spec(
        "AdamW's decoupled weight decay, on every parameter (norms, biases and embeddings too)", 0.01, ge=0, le=1
    )
    adam_beta1: float = spec("AdamW's first-moment decay (torch's default; LLM recipes keep 0.9)", 0.9, ge=0, le=0.9999)
    adam_beta2: float = spec(
        "AdamW's second-moment decay (torch's default 0.999; torchtitan and many LLM recipes use 0.95)",
        0.999,
        ge=0,
        le=0.99999,
    )
    adam_eps: float = spec("AdamW's epsilon, added to the root of the second moment", 1e-8, gt=0, le=1)
    max_grad_norm: float = spec(
        "clip the gradients to this global norm (over every stage and shard) before each optimizer step, "
        "as torch.nn.utils.clip_grad_norm_ does; 0: no clipping",
        1.0,
        ge=0,
        le=1e6,
    )

    def __hash__(self) -> int:
        """The fields' hash, computed once: the cost model's caches are keyed by the job, in hot loops."""
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def bytes_per_element(self) -> int:
        """Bytes per activation/weight element at the job's precision."""
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def grad_bytes_per_element(self) -> int:
        """Bytes per gradient element: 4 where gradients are kept in fp32 (``grad_dtype``), else the precision's."""
        return 4 if self.grad_dtype == "fp32" else self.bytes_per_element

    @property
    def batch(self) -> int:
        """The microbatch size of a resolved job (:meth:`resolved`): sequences per microbatch."""
        if self.microbatch_size is None:
            raise ConfigError("job.microbatch_size: not chosen yet; plan the job first (geosched plan)")
        return self.microbatch_size

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1 when not chosen)."""
        return self.tensor_parallel or 1

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage (0 when not chosen)."""
        return self.zero or 0

    @property
    def pipeline_schedule(self) -> ScheduleName:
        """The schedule (1f1b when not chosen)."""
        return self.schedule or "1f1b"

    def resolved(
        self,
        *,
        microbatch_size: int | None = None,
        schedule: ScheduleName | None = None,
        tensor_parallel: int | None = None,
        zero: int | None = None,
    ) -> JobSpec:
        """This job with every planner choice set: the arguments, else the pinned values, else
        the defaults (microbatch 1, 1f1b, no tensor parallelism, no ZeRO)."""
        return dataclasses.replace(
            self,
            microbatch_size=microbatch_size or self.microbatch_size or 1,
            schedule=schedule or self.pipeline_schedule,
            tensor_parallel=tensor_parallel or self.tp,
            zero=self.zero_stage if zero is None else zero,
        )


@dataclass(frozen=True)
class Config:
    """A whole config file."""

    cluster: ClusterSpec = spec("the cluster")
    job: JobSpec = spec("the job")


NAME_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}")
"""Cluster and datacenter names: they become MQTT topics, file names and command-line arguments of agents."""


def _cross_checks(cfg: Config) -> None:
    names = [dc.name for dc in cfg.cluster.datacenters]
    for where, name in [("cluster.name", cfg.cluster.name)] + [
        (f"cluster.datacenters[{i}].name", dc) for i, dc in enumerate(names)
    ]:
        if not NAME_RE.fullmatch(name):
            raise ConfigError(
                f"{where}: {name[:64]!r} is not a name: use 1-64 characters from A-Z a-z 0-9 _ . -, not starting with -"
            )
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"cluster.datacenters[{i}].name: duplicate datacenter {name!r}; names must be unique")
    if not names:
        raise ConfigError("cluster.datacenters: none listed; a job needs at least one datacenter")
    seen: dict[frozenset[str], int] = {}
    for i, link in enumerate(cfg.cluster.links):
        for end in link.between:
            if end not in names:
                raise ConfigError(f"cluster.links[{i}].between: unknown datacenter {end!r}; known: {', '.join(names)}")
        if link.between[0] == link.between[1]:
            raise ConfigError(
                f"cluster.links[{i}].between: a link joins two different datacenters (got {link.between[0]!r} twice)"
            )
        key = frozenset(link.between)
        if key in seen:
            raise ConfigError(
                f"cluster.links[{i}].between: duplicate of cluster.links[{seen[key]}] "
                f"({link.between[0]}-{link.between[1]}); list each pair once"
            )
        seen[key] = i
    job, model = cfg.job, cfg.job.model
    if model.hidden % model.heads:
        raise ConfigError(f"job.model.heads: hidden({model.hidden}) must be divisible by heads({model.heads})")
    if job.tensor_parallel is not None and model.heads % job.tensor_parallel:
        raise ConfigError(
            f"job.tensor_parallel: heads({model.heads}) must be divisible by tensor_parallel({job.tensor_parallel})"
        )
    tp, dcs = job.tensor_parallel, cfg.cluster.datacenters
    if tp is not None and tp > 1 and not any(dc.gpus_per_node % tp == 0 and dc.gpus >= tp for dc in dcs):
        nodes = ", ".join(sorted({str(dc.gpus_per_node) for dc in dcs}))
        raise ConfigError(
            f"job.tensor_parallel: no datacenter has a node of {tp} GPUs (gpus_per_node: {nodes}); tensor "
            "parallelism stays inside a node: pick a divisor of a gpus_per_node, or null to let the planner choose"
        )
    if model.custom_layers and len(model.custom_layers) != model.layers:
        raise ConfigError(
            f"job.model.custom_layers: has {len(model.custom_layers)} entries but "
            f"layers = {model.layers}; give one entry per layer"
        )
    masters = MIXED_PRECISION_STATE_BYTES
    if job.precision in ("bf16", "fp16") and job.optimizer_bytes_per_param < masters:
        _warn_once(
            f"job.optimizer_bytes_per_param: {job.optimizer_bytes_per_param:g} is below the {masters:g} bytes the "
            f"agents keep per {job.precision} parameter (an fp32 master and two fp32 moments); the planner will "
            f"under-predict memory: set {masters:g}"
        )
    if job.precision != "fp16" and job.initial_loss_scale != INITIAL_LOSS_SCALE:
        _warn_once(
            f"job.initial_loss_scale: set to {job.initial_loss_scale:g} but only fp16 scales its loss; this job "
            f"trains in {job.precision}, so it is ignored"
        )
    if job.lr_decay == "none" and job.lr_min_ratio != LR_MIN_RATIO:
        _warn_once(
            f"job.lr_min_ratio: set to {job.lr_min_ratio:g} but job.lr_decay is 'none', so the rate never decays "
            "to it and it is ignored; set lr_decay: linear or cosine"
        )
    if job.lr_warmup_steps >= job.steps:
        raise ConfigError(
            f"job.lr_warmup_steps: {job.lr_warmup_steps} is not below job.steps ({job.steps}), so the learning "
            "rate would never reach job.learning_rate; lower it (a few percent of the steps is usual)"
        )
    if job.microbatch_size is not None and job.global_batch % job.microbatch_size:
        raise ConfigError(
            f"job.global_batch: global_batch({job.global_batch}) must be a multiple of "
            f"microbatch_size({job.microbatch_size})"
        )
    _check_microbatches(job, cfg.cluster.total_gpus)


def _check_microbatches(job: JobSpec, gpus: int) -> None:
    """ConfigError when even one stage with a replica on every GPU would run more microbatches per pipeline than
    a schedule may hold (:data:`MAX_STAGE_MICROBATCHES`): no plan, and no simulation, could exist."""
    size = job.microbatch_size or max(b for b in MICROBATCH_SIZES if job.global_batch % b == 0)
    fewest = -(-job.global_batch // (size * gpus))  # one stage, one replica per GPU
    if fewest > MAX_STAGE_MICROBATCHES:
        given = "" if job.microbatch_size else " (null: the largest the planner tries)"
        raise ConfigError(
            f"job.global_batch: global_batch({job.global_batch}) / (microbatch_size({size}){given} x {gpus} GPUs) "
            f"= {fewest} microbatches per pipeline at the most replicas, over the {MAX_STAGE_MICROBATCHES} a "
            "schedule may hold; raise job.microbatch_size or lower job.global_batch"
        )


def config_from_dict(data: object, source: str = "config") -> Config:
    """Validate plain data (as read from YAML) into a :class:`Config`."""
    if not isinstance(data, dict):
        got = "nothing" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"{source}: expected a mapping with 'cluster' and 'job' (got {got})")
    cfg = load_dataclass(Config, data, path="")
    _cross_checks(cfg)
    return cfg


CONFIG_LIMITS = YamlLimits(max_bytes=1 << 20, max_depth=schema_depth(Config), max_nodes=100_000)
"""What a config file may contain: 1 MiB, nested no deeper than the schema (see :mod:`geosched.yamlload`)."""


def _is_plan(path: str) -> bool:
    """Whether the (readable, regular) file at ``path`` begins as a plan file does."""
    with open(path, "rb") as fh:
        return re.match(rb"version: [0-9]+\nschedule: ", fh.read(64)) is not None


def load_config(path: str | os.PathLike[str]) -> Config:
    """Load and validate a YAML config file (hostile text is refused by :mod:`geosched.yamlload`)."""
    path = os.fspath(path)
    try:
        data = read_yaml_file(path, ConfigError, "pass a config such as configs/demo-3dc.yaml", CONFIG_LIMITS)
    except ConfigError as exc:  # a plan's config nests one level deeper than a config allows: say what it is
        if "nested deeper than" in str(exc) and _is_plan(path):
            raise ConfigError(
                f"{path}: a plan file (written by 'geosched plan'), not a config; give the config it was made from, "
                "or use it where a plan goes ('geosched simulate PLAN', 'geosched launch CONFIG --plan PLAN')"
            ) from None
        raise
    try:
        return config_from_dict(data, source=path)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(f"{path}: ") else f"{path}: {message}") from None


def dump_config(cfg: Config) -> str:
    """The config as YAML text that :func:`load_config` reads back to an equal object."""
    return dump_yaml(dump_dataclass(cfg))
