"""The agent's training thread: one rank's session, its steps, its checkpoints.

:class:`RankWorker` runs on a daemon thread beside the agent's event loop (:mod:`agents.daemon`). It opens
the rank's :class:`~agents.stage.session.RankSession` (binding at once; connecting to peers once the job
starts, through the agent's address book), then trains each number of steps the agent requests and
reports through ``post``:

- ``post("step", record)``: one metrics record per step (:func:`metrics_record`);
- ``post("finished", next_step)``: a requested run of steps is done;
- ``post("failed", exc)``: the session failed (the agent reports it and exits).

With ``prefill_bind`` set, the worker also opens a :class:`~agents.prefill.swap.SwappablePrefillService`
(the job's model shape, seeded or ``prefill_weights``: a file from ``geosched export`` or a checkpoint
folder's newest complete step; with ``prefill_follow`` each newer step is swapped in between requests as it
completes), publishes its endpoint as ``prefill/r<R>`` (and with ``prefill_http`` its HTTP front end's URL
as ``prefill-http/r<R>``), lets the runtime fill bubbles with it, serves it outright while there are no
steps to run (between and after training requests), adds its metrics to every step record (``prefill``)
and writes them to ``run_dir/prefill-rank<R>.json``.

:class:`RankCheckpoints` is the rank's checkpoint policy on top of :mod:`agents.checkpoint.store`: replica 0
of each stage writes a shard every ``every`` steps and after the steps the coordinator names; ``--resume``
restores the newest complete checkpoint (every stage's shard present and verified); a corrupt one raises
CheckpointError and loads nothing. A tensor-parallel stage is saved whole (its tp ranks gather it, tp rank
0 writes, :mod:`agents.tp.whole`) and re-sharded on load, so a checkpoint does not depend on the tp degree
that wrote it. fp16's loss scale is saved and restored with it. Checkpoint ``n`` holds the state after
``n`` steps; a resume trains step ``n`` next.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from geosched.errors import LinkError
from geosched.lr_schedule import apply_settings, optimizer_settings
from geosched.yamlload import write_atomically

log = logging.getLogger(__name__)

IDLE_SLICE_S = 0.05
"""Between training requests: prefill chunk length (nothing waits for the stage)."""


CHECKPOINT_NOW = -1
"""A request (instead of a number of steps): write a checkpoint of the state now."""


class StopTraining(Exception):
    """Raised between steps inside the worker when the agent stops."""


METRICS_EVENTS_MAX_BYTES = 256 * 1024
"""Timed events above this (as JSON) stay out of a step's metrics (``events_dropped``): a payload is <= 1 MiB."""


def metrics_record(report: Any, role: Any) -> dict[str, Any]:
    """The metrics message of one step: the StepReport, plus bytes sent over the WAN (pipeline and gradient links).

    Replica 0's ranks add the step's timed events and idle gaps (the coordinator's measured timeline,
    :mod:`agents.runfolder.record`) unless they exceed :data:`METRICS_EVENTS_MAX_BYTES`; the others
    send none (the timeline shows replica 0's pipeline).
    """
    data = report.to_dict(with_events=role.replica == 0)
    if len(json.dumps(data.get("events", [])) + json.dumps(data.get("idle_gaps", []))) > METRICS_EVENTS_MAX_BYTES:
        data["events_dropped"] = len(data.pop("events")) + len(data.pop("idle_gaps"))
    data.update(dc=role.dc, wan_bytes=report.wan_bytes(role))
    record: dict[str, Any] = json.loads(json.dumps(data))  # JSON-safe: what the control plane sends
    return record


class RankCheckpoints:
    """When and how one rank writes and restores checkpoints."""

    def __init__(self, ckpt_dir: str, layout: Any, role: Any, every: int, resume: bool, keep: int = 0) -> None:
        from agents.checkpoint.store import job_fingerprint, model_fingerprint

        self.ckpt_dir, self.role, self.every, self.resume, self.keep = ckpt_dir, role, every, resume, keep
        self.num_stages = layout.num_stages
        self.job = job = layout.job
        self.fingerprint = job_fingerprint(
            job.model,
            role.layers,
            first=role.first,
            last=role.last,
            seed=job.seed,
            num_stages=layout.num_stages,
            precision=job.precision,
        )
        self.model_fingerprint = model_fingerprint(job.model, seed=job.seed, precision=job.precision)
        self._writer: Any = None
        self.loss_scale: Any = None  # fp16: the session's DynamicLossScale, saved and restored with the stage
        self.start_step = self._resume_step() if resume else 0

    def _resume_step(self) -> int:
        """The newest complete checkpoint, of this layout or another (resharded on restore); CheckpointError
        if there are checkpoints but none is complete."""
        from agents.checkpoint.store import latest_complete, list_steps, saved_stages, verify_step

        step = latest_complete(self.ckpt_dir, warn=True)
        if step is not None:
            return step
        steps = list_steps(self.ckpt_dir)
        if steps:
            verify_step(self.ckpt_dir, steps[-1], saved_stages(self.ckpt_dir, steps[-1]))  # raises, naming the fault
        log.info("rank %d: no checkpoint in %s; starting from step 0", self.role.rank, self.ckpt_dir)
        return 0

    def restore(self, module: Any, optimizer: Any) -> None:
        """Load this stage's state of the resume step (nothing when starting from 0): its own shard when the
        checkpoint has this layout, else resharded from every shard of the step (another stage split); and
        ``loss_scale`` (fp16), where the checkpoint has one."""
        if self.start_step > 0:  # the rate the checkpoint's last step had, unless the job's has changed since
            apply_settings(optimizer, optimizer_settings(self.job, self.start_step - 1))
            if self.role.tp_size > 1:  # the shard holds the whole stage: load a whole copy, keep this rank's shards
                from agents.checkpoint.state import load_optimizer_state
                from agents.tp.whole import load_whole_training_state

                whole, whole_optimizer = self._whole_stage()
                extra = self._load(whole, whole_optimizer)
                shards = load_whole_training_state(module, whole.state_dict(), whole_optimizer.state_dict())
                load_optimizer_state(optimizer, shards)  # ZeRO keeps its replica's share of them
            else:
                extra = self._load(module, optimizer)
            if self.loss_scale is not None and "loss_scale" in extra:
                self.loss_scale.load_state_dict(extra["loss_scale"])  # CheckpointError if malformed
            log.info("rank %d: resumed from checkpoint %d in %s", self.role.rank, self.start_step, self.ckpt_dir)

    def _load(self, module: Any, optimizer: Any) -> dict[str, Any]:
        from agents.checkpoint.load import load_resharded, load_shard, written_by

        step, stage = self.start_step, self.role.stage
        if written_by(self.ckpt_dir, step, stage, self.num_stages, self.fingerprint):
            return load_shard(self.ckpt_dir, step, stage, module, optimizer, job_fingerprint=self.fingerprint)
        log.info("rank %d: checkpoint %d has another stage split; resharding", self.role.rank, step)
        return load_resharded(self.ckpt_dir, step, stage, module, optimizer, model_fingerprint=self.model_fingerprint)

    def after_step(self, step: int, module: Any, optimizer: Any, asked: list[int | None]) -> int | None:
        """Write checkpoint ``step + 1`` if it is due or was asked for (after this step, or after one already
        past when the request arrived late: the next boundary then); return its step, None if not due."""
        done = step + 1
        due = (self.every > 0 and done % self.every == 0) or any(s is None or s <= step for s in asked)
        asked[:] = [s for s in asked if s is not None and s > step]
        if not due:
            return None
        self.save_now(done, module, optimizer)
        return done

    def save_now(self, done: int, module: Any, optimizer: Any) -> bool:
        """Write checkpoint ``done`` (the state after ``done`` steps), with ``loss_scale``; True if this rank
        writes."""
        from agents.checkpoint.state import gather_optimizer_state
        from agents.checkpoint.store import CheckpointWriter

        # ZeRO: every replica sends its share of the state to replica 0 (with tp: each tp rank over its "dp" group)
        gather_optimizer_state(optimizer)
        if self.role.replica != 0:  # replicas hold identical weights; replica 0 writes (it holds the whole state now)
            return False
        if self.role.tp_size > 1:  # replica 0's tp ranks gather the whole stage; its tp rank 0 writes it
            module, optimizer = self._whole_stage(module, optimizer)
            if self.role.tp_rank != 0:
                return False
        if self._writer is None:
            from geosched.weights import ModelRecord

            record = ModelRecord.of(self.job.model, self.job.seed, self.job.precision).to_dict()
            self._writer = CheckpointWriter(
                self.ckpt_dir, self.role.stage, self.num_stages, self.fingerprint, self.model_fingerprint, record
            )
        extra: dict[str, Any] = {"next_step": done}
        if self.loss_scale is not None:
            extra["loss_scale"] = self.loss_scale.state_dict()
        self._writer.save(done, module, optimizer, extra=extra)
        if self.keep and self.role.stage == 0:  # one writer prunes: the steps older than the keep newest complete
            self._writer.prune(self.keep)
        return True

    def _whole_stage(self, sharded: Any = None, sharded_optimizer: Any = None) -> tuple[Any, Any]:
        """An unsharded copy of this stage and an AdamW over it (MasterAdamW: fp32 masters for bf16), what a
        checkpoint holds; with a sharded stage given, holding its whole state (a collective: every tp rank of the
        replica calls it)."""
        from agents.tp.whole import whole_training_state
        from geosched.model import PRECISION_DTYPES, build_stage
        from geosched.optim import MasterAdamW

        job, role = self.job, self.role
        whole = build_stage(
            job.model,
            *role.layers,
            first=role.first,
            last=role.last,
            seed=job.seed,
            dtype=PRECISION_DTYPES[job.precision],
        )
        optimizer = MasterAdamW(whole.parameters(), **optimizer_settings(job, max(0, self.start_step - 1)))
        if sharded is not None:
            from agents.checkpoint.state import ShardedOptimizer

            saved = (  # ZeRO: the whole state gathered on this replica by save_now; else the optimizer's own
                sharded_optimizer.whole_state_dict()
                if isinstance(sharded_optimizer, ShardedOptimizer)
                else sharded_optimizer.state_dict()
            )
            module_state, optimizer_state = whole_training_state(sharded, saved)
            whole.load_state_dict(module_state)
            optimizer.load_state_dict(optimizer_state)
        return whole, optimizer


class RankWorker:
    """The thread that owns one rank's :class:`~agents.stage.session.RankSession` (see the module docstring).

    It is a daemon thread: a rank stuck on a dead peer cannot keep the process alive.
    """

    def __init__(
        self,
        layout: Any,
        role: Any,
        options: Any,
        book: Any,
        post: Callable[..., None],
        checkpoints: RankCheckpoints | None = None,
        metrics: Any = None,
    ) -> None:
        self.layout, self.role, self.opts, self.book, self.post = layout, role, options, book, post
        self.metrics = metrics  # the agent's AgentMetrics: told every prefill TTFT, reads the snapshots below
        if metrics is not None:
            metrics.sources.update(links=self.link_snapshots, prefill=self.prefill_snapshot)
        self.checkpoints = checkpoints
        self.start_step = checkpoints.start_step if checkpoints is not None else 0
        self._requests: queue.Queue[int | None] = queue.Queue()
        self._stop = threading.Event()
        self._checkpoint_asked: list[int | None] = []
        self._runtime: Any = None  # the session's StageRuntime once open (read by progress())
        self._links: dict[int, Any] = {}  # peer stage -> the session's WanLink once open (read by link_snapshots())
        self._service: Any = None  # the PrefillService once open (read by prefill_snapshot())
        self._http: Any = None  # its HTTP front end once open (its stats go into prefill_snapshot())
        self._thread = threading.Thread(target=self._main, name=f"geosched-rank{role.rank}", daemon=True)

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (it opens the session)."""
        self._thread.start()

    def progress(self) -> tuple[int | None, int]:
        """(step in progress, schedule actions done) of the rank's stage, for heartbeats (any thread)."""
        runtime = self._runtime
        return (None, 0) if runtime is None else (runtime.step_in_progress, runtime.actions_done)

    def link_snapshots(self) -> list[dict[str, Any]]:
        """``WanLink.metrics()`` of the rank's open links, each with ``peer_stage`` and ``peer_dc`` (any thread)."""
        role = self.role
        return [
            {"peer_stage": peer, "peer_dc": role.prev_dc if peer < role.stage else role.next_dc, **link.metrics()}
            for peer, link in list(self._links.items())
        ]

    def prefill_snapshot(self) -> dict[str, Any] | None:
        """The prefill service's metrics now (None without a service), also while idle (any thread)."""
        service, http = self._service, self._http
        if service is None:
            return None
        return {**service.metrics(), **({"http": http.stats()} if http is not None else {})}

    def request_steps(self, steps: int) -> None:
        """Train ``steps`` more steps once the session is open."""
        self._requests.put(steps)

    def request_checkpoint(self, step: int | None, idle: bool) -> None:
        """Checkpoint after ``step``; None: now when ``idle``, else after the step in progress."""
        if step is None and idle:
            self._requests.put(CHECKPOINT_NOW)
        else:
            self._checkpoint_asked.append(step)

    def stop(self, timeout_s: float) -> None:
        """Ask the thread to end (between steps) and wait up to ``timeout_s``."""
        self._stop.set()
        self._requests.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _main(self) -> None:
        from agents.stage.session import RankSession
        from geosched.data import default_corpus_paths

        opts, role = self.opts, self.role
        if opts.threads is not None:
            import torch

            torch.set_num_threads(opts.threads)
        out = None
        stack = ExitStack()
        service = None
        try:
            if opts.run_dir is not None:
                os.makedirs(opts.run_dir, exist_ok=True)
                out = open(os.path.join(opts.run_dir, f"rank{role.rank}.jsonl"), "a", encoding="utf-8")
            service = self._open_prefill(stack) if opts.prefill_bind else None
            opened = threading.Event()  # the session waits for the job to start, which may take long: meanwhile
            helper = None  # the prefill service serves on a helper thread with all of the time
            if service is not None:
                helper = threading.Thread(
                    target=service.serve_idle, args=(opened.is_set, IDLE_SLICE_S), name="prefill-idle", daemon=True
                )
                helper.start()
            try:
                session = stack.enter_context(
                    RankSession(
                        self.layout.job,
                        role,
                        data=opts.data or default_corpus_paths(),
                        addresses=self.book,
                        bind_host=opts.bind_host,
                        start_step=self.start_step,
                        connect_timeout_s=opts.connect_timeout_s,
                        recv_timeout_s=opts.recv_timeout_s,
                        wan_config={"chunk_bytes": opts.wan_chunk_bytes},
                        wan_turns=opts.wan_turns,
                        bubble_filler=service,
                        link_security=self._link_security(),
                        device=opts.device,
                        stopping=self._stop.is_set,
                    )
                )
            finally:
                opened.set()
                if helper is not None:
                    helper.join()
            self._runtime = session.runtime
            self._links = dict(session.transport.links) if session.transport is not None else {}
            if self.checkpoints is not None:
                self.checkpoints.loss_scale = session.loss_scale
                self.checkpoints.restore(session.module, session.optimizer)
            timed = not (opts.time_stage and opts.run_dir is not None)
            while (steps := self._next_request(service)) is not None and not self._stop.is_set():
                if steps == CHECKPOINT_NOW:
                    if self.checkpoints is not None:
                        self.checkpoints.save_now(session.start_step, session.module, session.optimizer)
                        self.post("checkpointed", session.start_step)
                    continue
                if not timed:  # the first steps reach every rank together: so do a tp stage's timed forwards
                    timed = True
                    self._time_stage(session)
                for report in session.train(steps):
                    if out is not None:
                        out.write(json.dumps({"rank": role.rank, **report.to_dict()}) + "\n")
                        out.flush()
                    record = metrics_record(report, role)
                    if service is not None:
                        service.record_step(report.busy_s, report.iteration_s)
                        record["prefill"] = self._prefill_metrics(service)
                    self.post("step", record)
                    if self.checkpoints is not None:
                        written = self.checkpoints.after_step(
                            report.step, session.module, session.optimizer, self._checkpoint_asked
                        )
                        if written is not None:
                            self.post("checkpointed", written)
                    if self._stop.is_set():
                        raise StopTraining
                session.start_step += steps
                self.post("finished", session.start_step)
        except (StopTraining, LinkError) as exc:
            if self._stop.is_set():
                log.info("rank %d: worker stopped", role.rank)
            else:
                self.post("failed", exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the agent loop
            if not self._stop.is_set():
                self.post("failed", exc)
        finally:
            stack.close()  # the session, then the prefill service (answers what is still queued)
            if service is not None:
                try:
                    self._prefill_metrics(service)  # final counts, including what was served after the last step
                except OSError as exc:
                    log.warning("rank %d: could not write the final prefill metrics: %s", role.rank, exc)
            if out is not None:
                out.close()

    def _next_request(self, service: Any) -> int | None:
        """The next training request; until one comes, the prefill service (if any) serves outside training."""
        if service is None:
            return self._requests.get()
        while not self._stop.is_set():
            try:
                return self._requests.get_nowait()
            except queue.Empty:  # no training to do: queued prompts need not wait for the next bubble
                service.serve_idle(lambda: not self._requests.empty() or self._stop.is_set(), IDLE_SLICE_S)
        return None

    def _open_prefill(self, stack: ExitStack) -> Any:
        """Load the served model, bind the prefill service, publish its endpoint; closed with ``stack``."""
        from agents.checkpoint.export import served_weights
        from agents.layout import prefill_name
        from agents.prefill.model import frozen, load_inference_model
        from agents.prefill.swap import SwappablePrefillService
        from geosched.endpoint import tcp_address, tcp_endpoint, unusable_host
        from geosched.weights import ModelRecord

        job, source = self.layout.job, self.opts.prefill_weights
        record = ModelRecord.of(job.model, job.seed, job.precision)
        whole, step = served_weights(source, record, follow=self.opts.prefill_follow)
        model = frozen(whole) if whole is not None else load_inference_model(job.model, None, seed=job.seed)
        model = model.to(self.opts.device)  # prefill fills the bubbles of the device the stage trains on
        served = f"the seeded initial weights (seed {job.seed})" if whole is None else str(source)
        if whole is not None and step is not None:  # a checkpoint folder, or a file exported from one
            served = f"checkpoint step {step} of {source}" if os.path.isdir(str(source)) else f"{source} (step {step})"
        keys, curve = self.opts.keys, None
        if keys is not None:  # CURVE with the rank's keypair: encrypted; only the token's client key connects
            curve = keys.prefill_server(self.role.rank, self.opts.prefill_token)
        service = stack.enter_context(
            SwappablePrefillService(
                model,
                served=served,
                step=step,
                bind=self.opts.prefill_bind,
                auth_token=self.opts.prefill_token,
                curve_server=curve,
            )
        )
        service.metrics_.on_ttft = None if self.metrics is None else self.metrics.observe_ttft
        self._service = service
        log.info("rank %d: prefill serves %s", self.role.rank, served)
        if self.opts.prefill_follow:
            self._follow_checkpoints(stack, service, record, step)
        host, port = tcp_address(service.endpoint, bind=True)
        if unusable_host(host) == "the any-address":  # bound everywhere: peers reach it at the agent's address
            host = self.opts.bind_host
        self.book.publish(prefill_name(self.role.rank), tcp_endpoint(host, port))
        if self.opts.prefill_http is not None:  # the OpenAI-style HTTP front end: the same service and queue
            from agents.layout import prefill_http_name
            from agents.prefill.http import PrefillHttpServer

            opts = self.opts
            http = stack.enter_context(
                PrefillHttpServer(
                    service, *opts.prefill_http, limits=opts.prefill_http_limits, tls=opts.prefill_http_tls
                )
            )
            self._http = http
            scheme = http.url.split(":", 1)[0]
            url = http.url if http.host not in ("0.0.0.0", "::", "") else f"{scheme}://{opts.bind_host}:{http.port}"
            self.book.publish(prefill_http_name(self.role.rank), url)
        return service

    def _follow_checkpoints(self, stack: ExitStack, service: Any, record: Any, step: int | None) -> None:
        """Serve each newer checkpoint that completes in the ``prefill_weights`` folder (swapped between requests)."""
        from agents.checkpoint.follow import CheckpointFollower
        from agents.prefill.model import frozen

        folder = self.opts.prefill_weights

        def serve(new_step: int, model: Any) -> None:
            service.replace_model(frozen(model), f"checkpoint step {new_step} of {folder}", new_step)

        stack.callback(CheckpointFollower(folder, record, step, serve).start().close)

    def _time_stage(self, session: Any) -> None:
        """Time the stage where it runs, before its first step (``--time-stage``; agents.stage.in_place)."""
        from agents.stage.in_place import time_stage, write_stage_time

        assert self.opts.run_dir is not None
        record = time_stage(self.layout.job, self.role, session.mesh, session.device)
        path = write_stage_time(self.opts.run_dir, self.role.rank, record)
        log.info(
            "rank %d: stage timed in place: F %.2f ms, B %.2f ms a sequence (%s)",
            self.role.rank,
            record["forward_s"] * 1e3,
            record["backward_s"] * 1e3,
            path,
        )

    def _link_security(self) -> Any:
        """CURVE on the rank's pipeline links from the job's keys (None without ``--keys``)."""
        keys = self.opts.keys
        if keys is None:
            return None
        from agents.stage.security import LinkSecurity

        public, secret = keys.curve_keypair(self.role.rank)
        return LinkSecurity(public_key=public, secret_key=secret, peer_public=keys.curve_public)

    def _prefill_metrics(self, service: Any) -> dict[str, Any]:
        """The service's metrics (JSON-safe), also written to ``run_dir/prefill-rank<R>.json``."""
        metrics: dict[str, Any] = json.loads(json.dumps(self.prefill_snapshot() or service.metrics()))
        if self.opts.run_dir is not None:
            write_atomically(os.path.join(self.opts.run_dir, f"prefill-rank{self.role.rank}.json"), json.dumps(metrics))
        return metrics
