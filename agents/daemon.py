"""The agent: one long-running asyncio daemon per GPU process, driven over the MQTT control plane.

Life of an agent (states are published retained on ``geosched/<job>/agents/<rank>/status``;
a last will marks it ``offline`` if it dies):

1. ``starting``: connected; waits for the plan (``--plan`` file, or the retained
   ``geosched/<job>/plan`` topic the coordinator publishes).
2. The plan is checked against the agent (its rank must exist, its ``--dc`` must
   be the rank's DC, its ``--device`` must hold the rank's part); a bad plan from
   the broker gives status ``error`` and an event naming the problem, and the
   agent waits for the next plan.
3. A worker thread opens the rank's :class:`~agents.stage.session.RankSession`: builds the
   stage, binds its link listener and (replica 0) its DP group store on port 0.
   Bound endpoints go into the agent's status (``endpoints``) and the state
   becomes ``ready``.
4. On ``start`` (``steps``; optional ``routes`` {endpoint name: address} telling
   ranks to reach a peer through another address, e.g. a WAN emulator relay),
   the ranks look up their peers' endpoints in the statuses (or the routes),
   connect, join the DP group and train; state ``training``, one metrics message
   per step. When the steps are done the state is ``ready`` again with
   ``next_step``; a further ``start`` continues from there.
5. ``checkpoint`` (and every ``--checkpoint-every`` steps) writes the stage's
   shard; ``stop`` or SIGTERM/SIGINT/SIGHUP (not under nohup): status ``stopped``, everything closed, exit 0.

Address exchange (see :class:`~agents.control.endpoints.MqttAddressBook`): endpoints ride in the
retained statuses of ``ready``/``training`` agents of the same plan
(``plan_id``), so peers on other hosts find them with no extra service.
With ``control_keys`` the control plane drops every plan and command not
signed by the coordinator and every status not signed by its rank's agent
(:mod:`agents.control.auth`), and a rank's endpoints are learnt only under
the names the plan gives that rank.

Example::

    geosched agent --mqtt mqtt://user:pw@broker:1883 --job demo --rank 3 --dc eu
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agents.checkpoint.folder import resume_point
from agents.control.auth import MAGIC, ControlKeys
from agents.control.endpoints import MqttAddressBook
from agents.control.losses import RETAINED_SETTLE_S
from agents.control.messages import HEARTBEAT_S, CommandMessage, PlanMessage, StatusMessage
from agents.control.messages import client_id as make_client_id
from agents.control.plane import AgentIdentity, ControlPlane
from agents.control.ready import duplicate_agent, left_behind, overwritten_by, warn_unechoed_status
from agents.control.takeover import live_holder
from agents.control.tasks import cancel_and_wait
from agents.keys import JobKeys
from agents.layout import (
    JobLayout,
    expected_endpoints,
    load_plan_file,
    metrics_name,
    parse_layout,
    plan_id,
    store_name,
)
from agents.metrics.families import AgentMetrics, loop_answers
from agents.metrics.server import MetricsServer, Networks
from agents.runnable import check_agent_fits
from geosched.errors import CheckpointError, GeoschedError, InputError, LinkTimeout

if TYPE_CHECKING:
    from agents.prefill.connections import HttpLimits

log = logging.getLogger(__name__)

ENDPOINT_STATES = ("ready", "training")
"""States whose ``endpoints`` are live: peers only connect to these."""
STOP_GRACE_S = 5.0
"""How long a stopping agent waits for its rank thread to finish the step in progress."""


@dataclass
class AgentOptions:
    """Everything ``geosched agent`` takes from its flags."""

    mqtt: str
    rank: int
    job: str = "geosched"
    dc: str | None = None
    plan_path: str | None = None
    bind_host: str = "127.0.0.1"
    run_dir: str | None = None
    data: list[str] | None = None
    threads: int | None = None
    ca_file: str | None = None
    peer_overrides: dict[str, str] = field(default_factory=dict)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 0  # the newest complete checkpoints kept (0: every one)
    resume: bool = False
    connect_timeout_s: float = 300.0
    recv_timeout_s: float = 120.0
    wan_chunk_bytes: int = 0
    wan_turns: bool = True  # a stage's replicas take turns on their shared WAN links (agents.stage.turns)
    time_stage: bool = False  # time the stage in place before step 0, into run_dir (agents.stage.in_place)
    prefill_bind: str | None = None  # serve prefill on this ZeroMQ endpoint (None: off)
    prefill_weights: str | None = None  # weights file or checkpoint folder of the served model (None: seeded)
    prefill_follow: bool = False  # serve each newer checkpoint that completes in the prefill_weights folder
    prefill_http: tuple[str, int] | None = None  # also serve prefill over HTTP on (host, port) (None: off)
    prefill_http_tls: ssl.SSLContext | None = None  # its TLS (None: plain HTTP, --prefill-http-insecure)
    prefill_http_limits: HttpLimits | None = None  # its bounds (None: the defaults)
    control_keys: ControlKeys | None = None  # sign statuses; obey only the coordinator's signed plans/commands
    keys: JobKeys | None = None  # the job's key folder (--keys): signing, CURVE on links and prefill, MQTT login
    prefill_token: str | None = None  # prefill clients must send this token (--prefill-token-file or --keys)
    metrics_bind: tuple[str, int] | None = None  # serve Prometheus /metrics and /health on (host, port) (None: off)
    metrics_tls: ssl.SSLContext | None = None  # its TLS (None: plain HTTP, --metrics-insecure)
    metrics_allow: Networks | None = None  # the only client networks it serves (None: any; --metrics-allow)
    device: str = "cpu"  # what the stage trains on: cpu or cuda:N (--device, resolved by agents.stage.device)


class Agent:
    """One rank's daemon; :meth:`run` returns the process exit code."""

    def __init__(self, options: AgentOptions) -> None:
        self.opts = options
        self.layout: JobLayout | None = None
        self.plan_id: str | None = None
        self.book: MqttAddressBook | None = None
        self.worker: Any = None
        self.cp: ControlPlane | None = None
        self._status: dict[str, Any] = {}
        self._stopped_by: str | None = None  # "command": a 'job stop' ended it, "replaced": a new plan (its final
        # status says so)
        self._checkpoints = 0  # written by this process: each acknowledgement differs from the one before
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics = AgentMetrics(  # always kept (cheap); served only with metrics_bind
            options.rank, options.job, stale_s=options.recv_timeout_s, grace_s=options.connect_timeout_s
        )
        self.metrics.sources["control"] = lambda: dict(vars(self.cp.stats)) if self.cp is not None else {}
        self._fixed: dict[str, str] = {}  # endpoints the process holds from start to exit (metrics)
        if options.plan_path is not None:  # bad input at start: exit 2 before connecting
            text = load_plan_file(options.plan_path)
            layout = parse_layout(text, options.plan_path)
            self._check_fits(layout)
            if options.prefill_bind and options.prefill_weights:  # weights of another model: refused now, not later
                from agents.checkpoint.export import check_served_source
                from geosched.weights import ModelRecord

                record = ModelRecord.of(layout.job.model, layout.job.seed, layout.job.precision)
                check_served_source(options.prefill_weights, record, follow=options.prefill_follow)
            self.layout, self.plan_id = layout, plan_id(text)

    def _check_fits(self, layout: JobLayout) -> None:
        """PlanError (one line) if this agent cannot run its rank of ``layout`` (:func:`check_agent_fits`), or its
        ``--device`` cannot hold the rank's part (:func:`agents.stage.device.check_device_fits`)."""
        check_agent_fits(layout, self.opts.rank, self.opts.dc)
        if self.opts.device != "cpu":  # torch only for a GPU
            from agents.stage.device import check_device_fits

            check_device_fits(layout, layout.role(self.opts.rank), self.opts.device)

    # -- status ------------------------------------------------------------------
    async def _set_status(self, state: str, **fields: Any) -> None:
        self._status = {k: v for k, v in {**self._status, **fields}.items() if v is not None}
        self._status["state"] = state
        self.metrics.status(self._status)
        assert self.cp is not None
        fields_out = {k: v for k, v in self._status.items() if k != "state"}
        await self.cp.publish_status(self.opts.rank, state, **fields_out)

    async def _announce(self, own: dict[str, str]) -> None:
        """Worker thread published an endpoint; ready once every expected one is there."""
        assert self.layout is not None
        opts = self.opts
        ready = expected_endpoints(self.layout, opts.rank, bool(opts.prefill_bind), bool(opts.prefill_http)) <= set(own)
        await self._set_status("ready" if ready else "starting", endpoints=own)

    # -- main loop -----------------------------------------------------------------
    async def run(self) -> int:
        """Connect, serve commands until stop/SIGTERM or failure; return the exit code."""
        opts, loop = self.opts, asyncio.get_running_loop()
        self._loop = loop
        stop_signals = [signal.SIGTERM, signal.SIGINT]
        if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # a closed terminal or ssh session; not under nohup
            stop_signals.append(signal.SIGHUP)
        for sig in stop_signals:
            loop.add_signal_handler(sig, self._inbox.put_nowait, ("signal", sig.name))
        identity, keys = AgentIdentity(opts.rank, dc=opts.dc), opts.control_keys
        # a restart takes over its predecessor's session, not a live agent's (agents.control.takeover); an agent of
        # the rank in another DC (one an elastic re-plan left behind, restarted by its supervisor) has another id
        role = f"agent-{opts.rank}" + (f"-{opts.dc}" if opts.dc else "")
        client_id = make_client_id(opts.job, role, unique=False)
        try:
            holder = await live_holder(opts.mqtt, opts.job, opts.rank, opts.dc, ca_file=opts.ca_file, keys=keys)
            if holder is not None:  # taking its session over would close it, and its will would stop the job
                log.error("rank %d: %s", opts.rank, holder)
                return 2
            async with ControlPlane(
                opts.mqtt, opts.job, client_id, agent=identity, ca_file=opts.ca_file, keys=keys
            ) as cp:
                self.cp = cp
                async with await cp.subscribe("plan", "command", "status") as sub:
                    await asyncio.sleep(RETAINED_SETTLE_S)  # the retained plan and statuses arrive
                    plan, held = cp.plan(), cp.statuses().get(opts.rank)
                    if (stale := left_behind(plan.text if plan else None, held, opts.rank, opts.dc)) is not None:
                        log.warning("rank %d: %s", opts.rank, stale)
                        return 0  # publishing nothing: the rank's status is its live agent's
                    await self._set_status("starting", endpoints=dict(self._fixed) or None)
                    echo = warn_unechoed_status(cp, opts.rank)
                    tasks = [asyncio.create_task(c) for c in (self._pump(sub), self._heartbeats(), echo)]
                    try:
                        code = await self._adopt(self.layout) if self.layout is not None else None
                        if code is None:
                            code = await self._serve()
                    finally:
                        await cancel_and_wait(tasks)
                        await self._shutdown_worker()
                stopped_by = self._stopped_by if code == 0 else None
                state, resume = "stopped" if code == 0 else "error", resume_point(self.opts.checkpoint_dir)
                await self._set_status(state, endpoints=None, stopped_by=stopped_by, next_step=resume)
                return code
        finally:
            for sig in stop_signals:
                loop.remove_signal_handler(sig)

    async def _pump(self, sub: Any) -> None:
        async for message in sub:
            await self._inbox.put(("mqtt", message))

    async def _heartbeats(self) -> None:
        """Every HEARTBEAT_S: this agent's state and its stage's progress (see agents.control.liveness)."""
        assert self.cp is not None
        seq = 0
        while True:
            step, actions = self.worker.progress() if self.worker is not None else (None, 0)
            state = self._status.get("state")
            with contextlib.suppress(GeoschedError):
                await self.cp.publish_heartbeat(self.opts.rank, seq, state=state, step=step, actions=actions)
            seq += 1
            await asyncio.sleep(HEARTBEAT_S)

    def post(self, *item: Any) -> None:
        """Thread-safe: hand an event from the worker thread to the agent's loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._inbox.put_nowait, item)

    async def _serve(self) -> int:
        while True:
            kind, *rest = await self._inbox.get()
            if kind == "signal":
                log.warning("rank %d: %s received; stopping", self.opts.rank, rest[0])
                return 0
            if kind == "mqtt":
                done = await self._on_message(rest[0])
                if done is not None:
                    return done
            elif kind == "step":
                await self._on_step(rest[0])
            elif kind == "finished":
                await self._set_status("ready", next_step=rest[0])
            elif kind == "checkpointed":  # the acknowledgement 'geosched job checkpoint' waits for
                folder, self._checkpoints = os.path.abspath(self.opts.checkpoint_dir or "."), self._checkpoints + 1
                mark = {"step": rest[0], "dir": folder, "count": self._checkpoints}
                await self._set_status(str(self._status.get("state", "ready")), checkpoint=mark)
            elif kind == "failed":
                return await self._on_failure(rest[0])

    async def _on_message(self, message: Any) -> int | None:
        if isinstance(message, PlanMessage):
            return await self._on_plan(message.text)
        elif isinstance(message, StatusMessage):
            if (clash := duplicate_agent(message, self.opts.rank, self._status, self.cp)) is not None:
                log.error("rank %d: %s", self.opts.rank, clash)
                return 2
            if (by := overwritten_by(message, self.opts.rank, self._status.get("state"))) is not None:
                log.warning("rank %d: %s marked it %s; republishing its status", message.rank, by, message.state)
                await self._set_status(self._status["state"])
                return None
            endpoints = message.extra.get("endpoints")
            if (
                self.book is not None
                and message.state in ENDPOINT_STATES
                and isinstance(endpoints, dict)
                and message.extra.get("plan_id") == self.plan_id
                and message.rank != self.opts.rank
            ):
                if self.opts.control_keys is not None:  # signed statuses: a rank announces only its own
                    endpoints = self._owned_endpoints(message.rank, endpoints)
                self.book.learn(endpoints)
        elif isinstance(message, CommandMessage):
            return await self._on_command(message)
        return None

    def _owned_endpoints(self, rank: int, endpoints: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``endpoints`` that the plan gives to ``rank`` (the rest are dropped and logged)."""
        assert self.layout is not None
        owned = expected_endpoints(self.layout, rank, True, True) if rank < len(self.layout.roles) else set()
        owned.add(metrics_name(rank))
        foreign = sorted(str(name)[:80] for name in endpoints if name not in owned)
        if foreign:
            log.warning(
                "rank %d: ignored endpoints %s announced by rank %d: not its own", self.opts.rank, foreign[:8], rank
            )
        return {name: address for name, address in endpoints.items() if name in owned}

    async def _on_plan(self, text: str) -> int | None:
        new_id = plan_id(text)
        if new_id == self.plan_id:
            return None
        if self.worker is not None:  # only a re-plan publishes over an open plan ('job start' refuses first)
            line = (
                f"rank {self.opts.rank}: plan {new_id} replaced plan {self.plan_id} (an elastic re-plan); stopping "
                "(restart with --resume to adopt it)"
            )
            log.warning("%s", line)
            await self._event("warning", line)
            self._stopped_by = "replaced"  # a stale agent back from a cut stops too, instead of failing later
            return 0
        try:
            if text.startswith(MAGIC.decode()) and self.opts.control_keys is None:
                raise InputError(
                    "the plan from the broker is signed (the job runs with signed control messages); restart this "
                    "agent with --keys DIR, the job's key folder (its own keys: geosched keys DIR --ranks N)"
                )
            layout = parse_layout(text, "plan from the broker")
            self._check_fits(layout)
        except InputError as exc:
            log.error("rank %d: %s", self.opts.rank, exc)
            await self._set_status("error", message=str(exc), plan_id=new_id)
            await self._event("error", f"rank {self.opts.rank}: {exc}")
            return None
        self.plan_id = new_id
        return await self._adopt(layout)

    async def _adopt(self, layout: JobLayout) -> int | None:
        """Start the worker for ``layout`` (it binds, then waits for ``start``); an exit code if it cannot."""
        from agents.worker import RankCheckpoints, RankWorker

        opts = self.opts
        self.layout = layout
        role = layout.role(opts.rank)
        await self._set_status(
            "starting",
            dc=role.dc,
            stage=role.stage,
            replica=role.replica,
            plan_id=self.plan_id,
            message=None,
            endpoints=dict(self._fixed),
        )
        checkpoints = None
        if opts.checkpoint_dir is not None:
            try:
                checkpoints = RankCheckpoints(
                    opts.checkpoint_dir, layout, role, opts.checkpoint_every, opts.resume, opts.checkpoint_keep
                )
            except GeoschedError as exc:  # a corrupt checkpoint: say so, load nothing, leave
                return await self._on_failure(exc)
        self.book = MqttAddressBook(asyncio.get_running_loop(), self._announce, opts.peer_overrides)
        self.book.own.update(self._fixed)
        self.worker = RankWorker(layout, role, opts, self.book, self.post, checkpoints, metrics=self.metrics)
        self._status["next_step"] = self.worker.start_step
        self._status.pop("data", None)  # an earlier plan's
        if role.first or role.last:  # the data it reads, which the coordinator compares across ranks
            from geosched.data import corpus_fingerprint, default_corpus_paths

            with contextlib.suppress(GeoschedError, OSError):  # bad --data: the worker fails, naming it
                data = opts.data or default_corpus_paths()
                self._status["data"] = corpus_fingerprint(data, layout.job.model.seq_len, layout.job.seed)
        self.worker.start()
        if not expected_endpoints(layout, opts.rank, bool(opts.prefill_bind), bool(opts.prefill_http)):
            await self._set_status("ready")
        for status in self.cp.statuses().values():  # type: ignore[union-attr]  # peers already live
            await self._on_message(status)
        return None

    async def _on_command(self, command: CommandMessage) -> int | None:
        if command.cmd == "stop":
            if command.extra.get("plan_id") not in (None, self.plan_id):
                return None  # a stop for the agents of another plan (an elastic recovery stopping the old one)
            log.info("rank %d: stop command", self.opts.rank)
            self._stopped_by = "command"  # its final status says so: the coordinator reads an operator's stop
            return 0
        if self.worker is None or self._status.get("state") not in ("ready", "training"):
            await self._event(
                "warning",
                f"rank {self.opts.rank}: ignored {command.cmd!r}: not ready (state {self._status.get('state')})",
            )
            return None
        if command.cmd == "start":
            if command.seq == self._status.get("started"):
                return None  # a re-sent start this agent already applied (its status acknowledges it)
            if self._status.get("state") == "training":  # another coordinator's: two 'job start' at once
                busy = f"training for start {self._status.get('started')}"
                await self._event("warning", f"rank {self.opts.rank}: ignored start {command.seq}: {busy}")
                return None
            routes = command.extra.get("routes") or {}
            steps = command.steps or self.layout.job.steps  # type: ignore[union-attr]
            self.book.open_gate(routes if isinstance(routes, dict) else {})  # type: ignore[union-attr]
            self.worker.request_steps(steps)
            await self._set_status("training", steps=steps, started=command.seq)
        elif command.cmd == "checkpoint":
            step = command.extra.get("step")
            if self.opts.checkpoint_dir is None:
                why = "it has no --checkpoint-dir; restart it with one"
                await self._event("warning", f"rank {self.opts.rank}: checkpoint asked but {why}")
                state = str(self._status.get("state", "ready"))
                await self._set_status(state, checkpoint={"seq": command.seq, "error": why})
                return None
            self.worker.request_checkpoint(
                step if isinstance(step, int) else None, idle=self._status.get("state") == "ready"
            )
        return None

    async def _on_step(self, record: dict[str, Any]) -> None:
        group = self.layout.role(self.opts.rank).group if self.layout is not None else None
        joined = self.book.found.get(store_name(group)) if self.book is not None and group else None
        if joined is not None and joined != self._status.get("joined"):  # the store its group was formed at
            await self._set_status(str(self._status.get("state", "training")), joined=joined)
        loss = record.get("loss")
        log.info(
            "rank %d step %d loss %s | iter %.1f ms | bubble %.1f%% | WAN sent %d B",
            self.opts.rank,
            record["step"],
            "n/a" if loss is None else f"{loss:.4f}",
            1e3 * record.get("iteration_s", 0.0),
            100 * record.get("bubble_fraction", 0.0),
            record.get("wan_bytes", 0),
        )
        self.metrics.step(record)
        await self.cp.publish_metrics(self.opts.rank, record)  # type: ignore[union-attr]

    async def _on_failure(self, exc: BaseException) -> int:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.error("rank %d failed: %s", self.opts.rank, exc)
        # not this rank's fault: the job's storage, or a WAN link that went quiet while this rank waited on it
        cause = "checkpoint" if isinstance(exc, CheckpointError) else "link" if isinstance(exc, LinkTimeout) else None
        await self._set_status("error", message=text[:500], cause=cause)  # the exit's status adds the resume point
        await self._event("error", f"rank {self.opts.rank}: {text[:500]}")
        return exc.exit_code if isinstance(exc, GeoschedError) else 1

    async def _event(self, level: str, message: str) -> None:
        with contextlib.suppress(GeoschedError):
            await self.cp.publish_event(level, message, rank=self.opts.rank)  # type: ignore[union-attr]

    def serve_metrics(self) -> MetricsServer | None:
        """The server of ``/metrics`` and ``/health`` on ``metrics_bind`` (status: ``metrics/r<rank>``); None: off."""
        opts, metrics = self.opts, self.metrics
        if opts.metrics_bind is None:
            return None
        health = lambda: metrics.health(loop_answers(self._loop))  # noqa: E731 - asked at each probe
        server = MetricsServer(
            *opts.metrics_bind,
            metrics.registry,
            health,
            tls=opts.metrics_tls,
            advertise_host=opts.bind_host,
            allow=opts.metrics_allow,
        )
        self._fixed[metrics_name(opts.rank)] = server.start().url()
        return server

    async def _shutdown_worker(self) -> None:
        if self.book is not None:
            self.book.stop("shutting down")
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop, STOP_GRACE_S)


def run_agent(options: AgentOptions) -> int:
    """Run the agent daemon to completion; the exit code (0 after stop/SIGTERM)."""
    agent = Agent(options)
    server = agent.serve_metrics()  # before connecting: a port that cannot be bound is bad input (exit 2)
    try:
        code = asyncio.run(agent.run())
    finally:
        if server is not None:
            server.close()
    if agent.worker is not None and agent.worker.alive:
        # a rank thread stuck in a peer's socket cannot be interrupted; leave without waiting for it
        log.warning("rank %d: worker thread still busy at exit; leaving it", options.rank)
        logging.shutdown()
        os._exit(code)
    return code


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``NAME=ADDRESS`` flags -> dict; InputError naming a malformed one."""
    out = {}
    for item in items:
        name, sep, address = item.partition("=")
        if not sep or not name or not address:
            raise InputError(f"--peer-override {item!r}: expected NAME=ADDRESS, e.g. pipe/s2/r0=tcp://10.0.0.5:7000")
        out[name] = address
    return out
