"""Everything one rank (one process, one GPU) needs to train its pipeline stage, wired from a layout.

:func:`run_rank` is what the agent daemon calls: it builds the stage of the
model from the rank's layer range (initialised from the job seed, identical
to the same layers of a one-process model), AdamW with the job's learning
rate (sharded over the data-parallel group at ZeRO stage ``job.zero``, see
:mod:`agents.dp.zero`), the data prefetcher (first stage: inputs; last stage: targets; both
read ``batch(step, replica, ...)`` independently and deterministically),
the links to the previous and next stage (compressed where the plan's link is,
``boundary_codecs``), the data-parallel group, and the lowered, validated
schedule; then it runs the steps and returns one
:class:`~agents.stage.report.StepReport` per step (also appended to
``run_dir/rank<R>.jsonl`` when a run folder is given).

Endpoints are exchanged through an :class:`~agents.stage.transport.AddressBook`:
a rank listens on port 0 for its previous stage and publishes the bound
endpoint; group rank 0 of each stage hosts its group's store on port 0 and
publishes it. Everything is closed on the way out, also on errors. With a
:class:`~agents.stage.security.LinkSecurity` both pipeline links use CURVE:
the listener admits only the upstream rank's public key, the connector only
talks to the downstream rank's.

``device`` (``geosched agent --device``, :mod:`agents.stage.device`) is where the stage trains: the CPU,
or a GPU, where its groups use NCCL and its links carry host copies of what it sends and receives.

With pipelines in several DCs (``role.sync``) a stage's group is its replicas
in this DC, and ALL_REDUCE is :class:`~agents.crossdc.sync.CrossDcSync`: the
hierarchical all-reduce over that group and WanLinks to the lane partners in
the neighbouring DCs (:class:`~agents.crossdc.links.SyncLinks`: listened for
and published with the pipeline link, connected after it, CURVE like it).

With tensor parallelism (``role.tp_size`` > 1) a stage's group has dp x tp
processes (group rank = replica x tp + tp_rank, :mod:`agents.tp.mesh`): the
stage is sharded over the mesh's "tp" dimension (:func:`agents.tp.shard.shard_stage`),
ALL_REDUCE averages over "dp" only (across DCs: tp rank j syncs its local shards
with tp rank j of its lane partners), ZeRO shards each tp rank's optimizer state
over "dp" only (:mod:`agents.dp.zero`), all tp ranks of a replica read the same
microbatches, and tp rank j of stage s talks to tp rank j of stage s+1. A
sharded stage's input and output are whole, replicated tensors; tp rank j sends
only slice j of their hidden dimension and the receiving tp ranks all-gather
the slices (:class:`~agents.stage.scatter.ScatterGatherTransport`, Megatron's
scatter/gather), so each boundary crosses the WAN once, not tp times.

Example (one process of a 2-stage, dp-1 job; the other runs ``roles[1]``)::

    roles = layout_roles(["us", "eu"], [(0, 2), (2, 4)], dp=1)
    book = StoreAddressBook.connect("127.0.0.1", store_port)
    reports = run_rank(cfg.job, roles[0], steps=10, data=default_corpus_paths(), addresses=book)
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from agents.crossdc.links import SyncLinks
from agents.crossdc.sync import CrossDcSync
from agents.dp.group import DataParallelGroup, join_group
from agents.dp.interface import pin_collective_interface
from agents.dp.spec import GroupSpec
from agents.dp.store import listening_store
from agents.dp.zero import build_stage_optimizer
from agents.layout import RankRole, pipe_name, store_name
from agents.runnable import sync_refusal, tp_refusal
from agents.stage.device import group_backend
from agents.stage.report import StepReport
from agents.stage.runtime import GradientSync, StageRuntime
from agents.stage.scatter import ScatterGatherTransport
from agents.stage.schedule import job_schedule
from agents.stage.security import LinkSecurity
from agents.stage.step_agreement import GradientShare
from agents.stage.transport import AddressBook, LinkTransport, boundary_codecs, link_id
from agents.stage.turns import shared_link_turns
from agents.tp.mesh import average_gradients_over_dp, stage_mesh
from agents.tp.shard import shard_stage
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from geosched.config import JobSpec
from geosched.data import Prefetcher, TextDataset
from geosched.endpoint import tcp_address, tcp_endpoint
from geosched.errors import PlanError
from geosched.lr_schedule import optimizer_settings
from geosched.model import PRECISION_DTYPES, StageModule, build_stage
from geosched.optim import loss_scale_for, set_gradient_dtype

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 10.0
"""How long group rank 0 keeps its group's store up for the other ranks to leave."""


class RankSession:
    """The open resources of one rank: stage model, optimizer, data, links, DP group, runtime.

    Open it with ``with RankSession(...) as session:``, then iterate
    :meth:`train`. Opening blocks until the neighbours and the group replicas
    are there (each step bounded by ``connect_timeout_s``).
    """

    def __init__(
        self,
        job: JobSpec,
        role: RankRole,
        *,
        data: TextDataset | str | Sequence[str],
        addresses: AddressBook,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        start_step: int = 0,
        connect_timeout_s: float = 60.0,
        recv_timeout_s: float = 120.0,
        wan_config: dict[str, Any] | None = None,
        backend: str | None = None,
        bubble_filler: Any = None,
        link_security: LinkSecurity | None = None,
        wan_turns: bool = True,
        device: torch.device | str = "cpu",
        stopping: Callable[[], bool] | None = None,
    ) -> None:
        self.job, self.role = job, role
        self.stopping = stopping  # polled while the links wait for their peers: an agent stopped meanwhile
        self.device = torch.device(device)  # the stage's weights, optimizer state and activations (agents.stage.device)
        self.wan_turns = wan_turns  # the group's replicas take turns on their shared WAN links (agents.stage.turns)
        self.link_security = link_security  # CURVE on both pipeline links (None: plain TCP)
        self.bubble_filler = bubble_filler  # e.g. a PrefillService: runs inside the runtime's bubbles
        self.data = data
        self.addresses = addresses
        self.bind_host = bind_host
        self.advertise_host = advertise_host or bind_host  # what peers connect to (bind 0.0.0.0, advertise a name)
        self.start_step = start_step
        self.next_step = start_step  # the step train() runs next (a checkpoint saves it)
        self.connect_timeout_s = connect_timeout_s
        self.recv_timeout_s = recv_timeout_s
        self.wan_config = dict(wan_config or {})
        self.backend = backend
        refusal = tp_refusal(job) or (sync_refusal(job) if role.sync is not None else None)
        if refusal is not None:
            raise PlanError(f"rank {role.rank}: {refusal}")
        self.schedule = job_schedule(job, role.num_stages, role.dp_size, role.warmup or None)
        self._stack = ExitStack()
        self.module: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.prefetcher: Prefetcher | None = None
        self.transport: LinkTransport | ScatterGatherTransport | None = None
        self.mesh: DeviceMesh | None = None  # the stage's ("dp", "tp") mesh when tp > 1
        self.group: DataParallelGroup | None = None
        self.sync_links: SyncLinks | None = None  # gradient links to the lane partners in other DCs
        self.grad_sync: GradientSync | None = None  # what ALL_REDUCE runs
        self.runtime: StageRuntime | None = None
        self.loss_scale = loss_scale_for(job.precision, job.initial_loss_scale)  # fp16; a checkpoint restores it
        self._hosted_store: Any = None

    def __enter__(self) -> RankSession:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        job, role = self.job, self.role
        start, end = role.layers
        self.module = build_stage(
            job.model,
            start,
            end,
            first=role.first,
            last=role.last,
            seed=job.seed,
            dtype=PRECISION_DTYPES[job.precision],
        ).to(self.device)  # initialised on the host from the seed, as every layout's copy of these layers is
        self.module.recompute = job.recompute == "full"  # each block's input kept, the rest again in its backward
        listener = self._listen_and_host()
        log.debug("rank %d: listening", role.rank)
        self.transport = self._connect(listener)
        log.debug("rank %d: links open", role.rank)
        self.group = self._join_group()
        log.debug("rank %d: group joined", role.rank)
        self.optimizer, in_dc = self._build_optimizer()
        self.grad_sync = grad_sync = self._across_dcs(in_dc)
        if self.mesh is not None and self.transport is not None:
            self.transport = self._scatter_gather(self.transport, self.mesh)
        if role.first or role.last:
            dataset = (
                self.data
                if isinstance(self.data, TextDataset)
                else TextDataset(self.data, seq_len=job.model.seq_len, seed=job.seed)
            )
            self.prefetcher = self._stack.enter_context(
                Prefetcher(
                    dataset,
                    role.replica,
                    role.dp_size,
                    job.batch,
                    self.schedule.num_microbatches,
                    start_step=self.start_step,
                )
            )
        group = self.group if self.group is not None and self.group.size > 1 else None
        share = GradientShare(  # what this rank counts of the gradients' global norm, summed over its group
            replica=group.rank // role.tp_size if group is not None else 0,
            tp_rank=role.tp_rank,
            group_sum=group.sum if group is not None else None,
        )
        self.runtime = StageRuntime(
            self.module,
            self.schedule,
            role.stage,
            transport=self.transport,
            optimizer=self.optimizer,
            grad_sync=grad_sync,  # ZeRO-2: the optimizer reduce-scatters instead; tp: over "dp" only
            replica=role.replica,
            recv_timeout_s=self.recv_timeout_s,
            bubble_filler=self.bubble_filler,
            loss_scale=self.loss_scale,
            share=share,
            max_grad_norm=job.max_grad_norm,
            settings=functools.partial(optimizer_settings, self.job),
        )
        log.info(
            "rank %d ready: stage %d/%d replica %d/%d layers [%d, %d) in %s",
            role.rank,
            role.stage,
            role.num_stages,
            role.replica,
            role.dp_size,
            start,
            end,
            role.dc,
        )

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, GradientSync | None]:
        """The optimizer and what ALL_REDUCE runs: AdamW at the job's ZeRO stage. With tp > 1 the stage is
        sharded first; gradients are averaged and ZeRO shards the state over the mesh's "dp" dimension only
        (tp rank j of every replica in this DC), on each tp rank's local shards (:mod:`agents.dp.zero`)."""
        job, role, module = self.job, self.role, self.module
        if role.tp_size == 1:
            assert module is not None
            set_gradient_dtype(module.parameters(), job.grad_dtype)
            built = build_stage_optimizer(module, lr=job.learning_rate, zero=job.zero_stage, group=self.group)
            return built.optimizer, built.grad_sync
        assert isinstance(module, StageModule) and self.group is not None
        dp_here = role.group_size // role.tp_size  # the stage's replicas in this group (across DCs: in this DC)
        mesh = self.mesh = stage_mesh(dp_here, role.tp_size)
        shard_stage(module, mesh["tp"])
        set_gradient_dtype(module.parameters(), job.grad_dtype)  # on the sharded parameters: new tensors
        built = build_stage_optimizer(
            module, lr=job.learning_rate, zero=job.zero_stage, group=self.group, replicas=mesh.get_group("dp")
        )
        if built.grad_sync is not None:  # ZeRO 2: the optimizer reduce-scatters over "dp"
            return built.optimizer, built.grad_sync
        return built.optimizer, _MeshGradientSync(self.group, mesh) if dp_here > 1 else None

    def _scatter_gather(self, links: LinkTransport, mesh: DeviceMesh) -> ScatterGatherTransport:
        """The links of a tp rank: its slice of each boundary tensor out, the tp ranks' slices all-gathered in."""
        role, tp_mesh = self.role, mesh["tp"]
        assert tp_mesh.get_local_rank() == role.tp_rank, (tp_mesh.get_local_rank(), role.tp_rank)
        assert self.group is not None
        return ScatterGatherTransport(
            links, tp_mesh.get_group(), hidden=self.job.model.hidden, stage=role.stage, guard=self.group.guard
        )

    def _across_dcs(self, in_dc: GradientSync | None) -> GradientSync | None:
        """What ALL_REDUCE runs: the in-DC sync, unless the stage's replicas live in several DCs; then the
        hierarchical all-reduce over the in-DC group and the gradient links (:mod:`agents.crossdc`)."""
        role = self.role
        if role.sync is None or len(role.sync.chain) == 1:
            return in_dc
        links = self.sync_links.links if self.sync_links is not None else {}  # none: a replica without a lane
        where = f"stage {role.stage} replica {role.replica} in {role.dc}"
        replicas = self.mesh.get_group("dp") if self.mesh is not None else None  # tp: this tp rank's replicas
        return CrossDcSync(role.sync, links, self.group, replicas=replicas, name=where, timeout_s=self.recv_timeout_s)

    def _link_config(self, upstream_stage: int, streams: int) -> WanLinkConfig:
        """The link between ``upstream_stage`` and the next one, seen from this rank (it is one of the two)."""
        role = self.role
        listening = upstream_stage == role.stage - 1
        peer_stage = upstream_stage if listening else role.stage + 1
        width = role.dp_size * role.tp_size  # ranks per stage
        if role.rank != role.stage * width + role.pipeline_index:  # how layout_roles numbers ranks
            raise PlanError(
                f"rank {role.rank} is not (stage {role.stage} x dp {role.dp_size} + replica {role.replica}) "
                f"x tp {role.tp_size} + tp rank {role.tp_rank}"
            )
        peer_rank = peer_stage * width + role.pipeline_index  # the same replica and tp rank
        peer_dc = role.prev_dc if listening else role.next_dc
        options: dict[str, Any] = {
            "connect_timeout_s": self.connect_timeout_s,
            "recv_timeout_s": self.recv_timeout_s,
            "peer_name": f"stage {peer_stage} (rank {peer_rank} in {peer_dc})",
            **self.wan_config,
        }
        if self.link_security is not None:
            if listening:
                options["curve_server"] = self.link_security.server(peer_rank)
            else:
                options["curve_client"] = self.link_security.client(peer_rank)
        return WanLinkConfig(link_id=link_id(upstream_stage, role.pipeline_index), streams=streams, **options)

    def _listen_and_host(self) -> WanLink | None:
        """Everything that only binds: the link for stage-1, the gradient link for the previous DC's lane
        partner, and (group rank 0) the group's store."""
        role, listener = self.role, None
        if role.sync is not None and role.sync.lane is not None and len(role.sync.chain) > 1:
            security = self.link_security
            self.sync_links = SyncLinks(
                role,
                addresses=self.addresses,
                bind_host=self.bind_host,
                advertise_host=self.advertise_host,
                curve_server=security.server if security is not None else None,
                curve_client=security.client if security is not None else None,
                connect_timeout_s=self.connect_timeout_s,
                recv_timeout_s=self.recv_timeout_s,
                wan_config=self.wan_config,
                stopping=self.stopping,
            )
            self._stack.callback(self.sync_links.close)
            self.sync_links.listen()
        if not role.first:
            config = self._link_config(role.stage - 1, role.streams_prev)
            listener = WanLink.listen(tcp_endpoint(self.bind_host, 0), config)
            self._stack.callback(listener.close)
            name = pipe_name(role.stage, role.replica, role.tp_rank)
            self.addresses.publish(name, tcp_endpoint(self.advertise_host, listener.port))
        if role.group_size > 1 and role.group_rank == 0:
            store = listening_store(self.bind_host, 0, role.group_size, timedelta(seconds=self.connect_timeout_s))
            self._hosted_store = store  # lives until close(), after the group is gone
            self.addresses.publish(store_name(role.group), tcp_endpoint(self.advertise_host, store.port))
        return listener

    def _connect(self, listener: WanLink | None) -> LinkTransport | None:
        role = self.role
        links = {}
        if listener is not None:
            links[role.stage - 1] = listener
        if not role.last:
            name = pipe_name(role.stage + 1, role.replica, role.tp_rank)
            endpoint = self.addresses.lookup(name, self.connect_timeout_s)
            link = WanLink.connect(endpoint, self._link_config(role.stage, role.streams_next))
            self._stack.callback(link.close)
            links[role.stage + 1] = link
        if listener is not None:
            listener.wait_peer(self.connect_timeout_s, self.stopping)
        if self.sync_links is not None:
            self.sync_links.connect()
        if not links:
            return None
        return LinkTransport(links, stage=role.stage, codecs=boundary_codecs(self.job, role), device=self.device)

    def _join_group(self) -> DataParallelGroup | None:
        role = self.role
        if role.group_size == 1:
            return None
        host, port = tcp_address(self.addresses.lookup(store_name(role.group), self.connect_timeout_s))
        spec = GroupSpec(
            role.group,
            role.group_rank,
            role.group_size,
            host,
            port,
            backend=self.backend or group_backend(self.device),
            timeout_s=self.connect_timeout_s,
            host_store=False,
            local_rank=self.device.index or 0,
        )
        pin_collective_interface(self.bind_host)  # gloo's address: --bind-host's interface, not the host name's
        self._stack.callback(self._leave_store, host, port)  # runs after the group is destroyed
        if self.wan_turns and isinstance(self.transport, LinkTransport):
            turns = shared_link_turns(role, host, port, timeout_s=self.recv_timeout_s)
            self.transport.take_turns(turns)
            for each in set(turns.values()):
                self._stack.callback(each.close)
        return self._stack.enter_context(join_group(spec))

    def _leave_store(self, host: str, port: int) -> None:
        """Group ranks say they have left the group; rank 0 keeps hosting the store until they all have.

        Otherwise a replica still tearing down its group would find the store gone.
        """
        keys = [f"geosched-left/{r}" for r in range(1, self.role.group_size)]
        try:
            if self._hosted_store is not None:
                self._hosted_store.wait(keys, timedelta(seconds=LEAVE_TIMEOUT_S))
            else:
                client = dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
                    host, port, is_master=False, timeout=timedelta(seconds=LEAVE_TIMEOUT_S)
                )
                client.set(f"geosched-left/{self.role.group_rank}", "1")
        except Exception as exc:  # noqa: BLE001 - a peer that failed first; nothing left to protect
            log.debug("rank %d: leaving the group store: %s", self.role.rank, exc)

    def train(self, steps: int) -> Iterator[StepReport]:
        """Run the next ``steps`` iterations (from ``start_step``, then on); yield each step's report.

        Every rank of the job must be asked for the same steps. At the end the
        sends are flushed and the DP replicas meet in a barrier.
        """
        assert self.runtime is not None, "open the session first (with RankSession(...) as s)"
        for _ in range(steps):
            step = self.next_step
            microbatches = self.prefetcher.get(step) if self.prefetcher is not None else None
            if microbatches is not None and self.device.type != "cpu":
                microbatches = [(x.to(self.device), y.to(self.device)) for x, y in microbatches]
            sync = self.grad_sync if isinstance(self.grad_sync, CrossDcSync) else None
            before = dict(sync.bytes_sent) if sync is not None else {}
            report = self.runtime.run_step(step, microbatches)
            if sync is not None:  # what this rank's cross-DC gradient links carried, per peer DC
                report.sync_bytes = {dc: n - before.get(dc, 0) for dc, n in sync.bytes_sent.items()}
            self.next_step = step + 1
            yield report
        if self.transport is not None:
            self.transport.flush(self.recv_timeout_s)
        if self.group is not None:
            self.group.barrier()  # nobody tears the group down while a replica still reduces

    def close(self) -> None:
        """Close links, group, store and data producers (idempotent)."""
        self._stack.close()
        self._hosted_store = None


class _MeshGradientSync:
    """ALL_REDUCE of a tensor-parallel stage: gradients averaged over the mesh's "dp" dimension only."""

    def __init__(self, group: DataParallelGroup, mesh: DeviceMesh) -> None:
        self.group, self.mesh = group, mesh

    def allreduce_gradients(self, module: torch.nn.Module) -> None:
        """Average ``module``'s gradients (local shards) over the replicas; failures name the missing rank."""
        with self.group.guard("gradient all-reduce over dp"):
            average_gradients_over_dp(module, self.mesh)


def run_rank(
    job: JobSpec,
    role: RankRole,
    *,
    steps: int,
    data: TextDataset | str | Sequence[str],
    addresses: AddressBook,
    run_dir: str | os.PathLike[str] | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    threads: int | None = None,
    link_security: LinkSecurity | None = None,
    **session_options: Any,
) -> list[StepReport]:
    """Open a :class:`RankSession`, train ``steps`` steps, close; return the per-step reports.

    ``on_step`` is called with each report as it is made (the daemon publishes
    it); ``threads`` sets torch's intra-op threads (1 when many ranks share a
    machine); ``link_security`` puts CURVE on both pipeline links (only the
    neighbour ranks' keys connect). Other keyword arguments go to :class:`RankSession`.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    out = None
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
        out = open(os.path.join(run_dir, f"rank{role.rank}.jsonl"), "a", encoding="utf-8")
    reports: list[StepReport] = []
    try:
        with RankSession(
            job, role, data=data, addresses=addresses, link_security=link_security, **session_options
        ) as session:
            for report in session.train(steps):
                reports.append(report)
                if out is not None:
                    out.write(json.dumps({"rank": role.rank, **report.to_dict()}) + "\n")
                    out.flush()
                if on_step is not None:
                    on_step(report)
    finally:
        if out is not None:
            out.close()
    return reports
