"""The stage runtime: the one interpreter that executes a pipeline schedule on a real PyTorch stage.

:class:`StageRuntime` runs the lowered action list of its stage (see
:mod:`geosched.schedule`) once per training step:

====================  ==========================================================
``RECV_F k``          activation of microbatch k from stage s-1 (becomes the
                      stage input, ``requires_grad``)
``F k``               forward; the first stage takes token ids, the last stage
                      computes the loss against the targets
``SEND_F k``          send the output activation (detached) to stage s+1
``RECV_B k``          gradient of the output from stage s+1
``B k``               ``torch.autograd.backward(output, grad)``; on the last
                      stage ``(loss / m).backward()``; keeps the input grad
``I k``               zero bubble: the gradient of the stage input; the linear
                      layers keep their inputs and output gradients for W instead
                      of computing their weight gradients (:mod:`geosched.wgrad`;
                      torch's ``stage_backward_input`` on tensor-parallel stages);
                      same loss scaling as B on the last stage
``W k``               zero bubble: the weight gradients of microbatch k from what
                      I kept, accumulated into ``.grad`` (or earlier, in a
                      receive's wait: :meth:`StageRuntime._weights_in_wait`). On
                      the first stage the input is token ids, with no gradient to
                      send: I runs the whole backward, W is a no-op
``SEND_B k``          send the input grad to stage s-1 (after B or I)
``ALL_REDUCE``        average gradients over the stage's data-parallel group (ZeRO 2 reduce-scatters
                      each microbatch's as its B or W ends, and finishes here)
``STEP``              optimizer step, then zero the gradients; clipped to the
                      global norm, and in fp16 (a loss scale) only where every
                      stage's gradients are finite
====================  ==========================================================

Clipping (``max_grad_norm``) and fp16 (``loss_scale``: the last stage's backward
starts from the loss times the scale) need every stage's gradients: STEP agrees
on their square sum with the group and the other stages over the links
(:mod:`agents.stage.step_agreement`), then clips, and steps where it is finite.

Every action is timed (``time.perf_counter``, seconds from the start of the
step) into :class:`~geosched.schedule.Event` records with the simulator's
categories, so :func:`agents.stage.report.measured_timeline` builds a
:class:`~geosched.schedule.Timeline` the same views draw. A receive whose
message had not arrived when it started (``transport.poll``) is an ``idle``
event and an :class:`~geosched.schedule.IdleGap`: a bubble. With a
``bubble_filler`` (the prefill service) the bubble first runs prefill chunks,
sized to the wait that receive had last step, until the message is there
(``"prefill"`` events, before the receive's own event).

When an action fails, the runtime raises the error's own GeoschedError class
(or :class:`~geosched.errors.StageError` for anything else) with the schedule
grid in the message and the failing action marked ``>1B3<``.

Example::

    runtime = StageRuntime(stage_module, lower(build_schedule("1f1b", 2, 4)), stage=0,
                           transport=transport, optimizer=torch.optim.AdamW(stage_module.parameters()))
    report = runtime.run_step(step, microbatches)   # StepReport: loss, iteration_s, events, bytes
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import Tensor, nn

from agents.stage.memory import MemoryMeter
from agents.stage.report import StepReport
from agents.stage.step_agreement import GradientShare, PipelineSum, StepAgreement, step_together
from agents.stage.step_state import Microbatch, StepState, same_instant
from agents.stage.transport import StageTransport
from geosched.errors import GeoschedError, StageError, TrainingDiverged
from geosched.lr_schedule import apply_settings
from geosched.optim import DynamicLossScale
from geosched.schedule import Action, ActionKind, Event, IdleGap, Schedule, lower, render_grid, validate
from geosched.wgrad import SplitBackward

log = logging.getLogger(__name__)

K = ActionKind

RECV_AHEAD = 2
"""Receives posted ahead of the action that needs them: each is on its link one or two actions early, so
its message lands straight in its future (torch's 1F1B posts each irecv only when it needs it) and a
receive whose message is there costs no hand-off to the link's I/O thread."""

_COMPUTE = (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.STEP)
_CATEGORY = dict.fromkeys(_COMPUTE, "compute") | dict.fromkeys((K.SEND_F, K.SEND_B, K.ALL_REDUCE), "comm")


class GradientSync(Protocol):
    """What ALL_REDUCE needs of a data-parallel group (``agents.dp.group.DataParallelGroup``)."""

    def allreduce_gradients(self, module: nn.Module) -> None:
        """Replace every ``.grad`` of ``module`` by its average over the group."""
        ...


@runtime_checkable
class MicrobatchReduce(Protocol):
    """A gradient sync that reduces each microbatch's gradients as its backward ends (ZeRO 2,
    ``agents.dp.zero2.ShardedGradAdamW``): the runtime tells it when a backward is done, and which
    parameters a zero-bubble W gave a gradient by hand."""

    def grad_ready(self, param: Tensor) -> None: ...

    def backward_done(self) -> None: ...


class StageModel(Protocol):
    """What the runtime needs of a stage (``geosched.model.StageModule``)."""

    first: bool
    last: bool

    def __call__(self, x: Tensor) -> Tensor: ...

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor: ...

    def parameters(self) -> object: ...


class BubbleFiller(Protocol):
    """Work that runs inside bubbles (``agents.prefill.service.PrefillService``)."""

    def fill(self, ready: Callable[[], bool], budget_s: float | None) -> Sequence[Any]:
        """Run chunks until ``ready()``; return them (each with ``start``/``end`` perf_counter seconds)."""
        ...


class StageRuntime:
    """Executes one stage's actions of ``schedule`` for each training step."""

    def __init__(
        self,
        module: StageModel,
        schedule: Schedule,
        stage: int,
        *,
        transport: StageTransport | None,
        optimizer: torch.optim.Optimizer,
        grad_sync: GradientSync | None = None,
        replica: int = 0,
        recv_timeout_s: float = 120.0,
        bubble_filler: BubbleFiller | None = None,
        loss_scale: DynamicLossScale | None = None,
        share: GradientShare | None = None,
        max_grad_norm: float = 0.0,
        settings: Callable[[int], Mapping[str, Any]] | None = None,
    ) -> None:
        schedule = lower(schedule)
        validate(schedule)
        if not 0 <= stage < schedule.num_stages:
            raise StageError(f"stage {stage} is not in schedule {schedule.name!r} with {schedule.num_stages} stages")
        expect_first, expect_last = stage == 0, stage == schedule.num_stages - 1
        if (module.first, module.last) != (expect_first, expect_last):
            raise StageError(
                f"stage {stage} of {schedule.num_stages} needs first={expect_first}, last={expect_last}, "
                f"but its model part has first={module.first}, last={module.last}; build it with the plan's layer range"
            )
        if transport is None and schedule.num_stages > 1:
            raise StageError(
                f"stage {stage} of a {schedule.num_stages}-stage pipeline needs a transport to its neighbours"
            )
        self.module = module
        self.schedule = schedule
        self.stage = stage
        self.replica = replica
        self.actions = schedule.actions[stage]
        self.transport = transport
        self.optimizer = optimizer
        self.grad_sync = grad_sync
        self.recv_timeout_s = recv_timeout_s
        self.bubble_filler = bubble_filler
        self.loss_scale = loss_scale  # fp16's dynamic loss scale (None: gradients are not scaled)
        self.settings = settings  # step -> its STEP's optimizer settings, lr among them (None: the optimizer's own)
        self.agreement = StepAgreement(  # what STEP agrees on with the group and the other stages
            PipelineSum(transport, stage, module.first, module.last, recv_timeout_s),
            share or GradientShare(),
            max_grad_norm,
            loss_scale,
        )
        self._last_wait: dict[tuple[str, int], float] = {}  # (kind, mb) -> seconds that receive waited last step
        self.num_microbatches = schedule.num_microbatches
        self._names = [str(action) for action in self.actions]  # the events' action strings, made once
        self._receives = [
            (self.stage - 1 if a.kind is K.RECV_F else self.stage + 1, "F" if a.kind is K.RECV_F else "B", a.microbatch)
            for a in self.actions
            if a.kind in (K.RECV_F, K.RECV_B)
        ]
        seen = 0
        self._post_before: list[int] = []  # receives to have posted before action i runs
        for action in self.actions:
            self._post_before.append(min(len(self._receives), seen + RECV_AHEAD))
            seen += action.kind in (K.RECV_F, K.RECV_B)
        split = any(action.kind is K.BACKWARD_INPUT for action in self.actions) and not module.first
        optimizer.zero_grad(set_to_none=True)
        # a StageModel is a StageModule, an nn.Module; the Protocol only names what the runtime calls
        self.memory = MemoryMeter(cast("nn.Module", module), optimizer)
        self._split = SplitBackward(cast("nn.Module", module), self.memory.adjust) if split else None
        self._reduce = grad_sync if isinstance(grad_sync, MicrobatchReduce) else None
        # Ws a receive's wait may run early: pure local products (deferred linear layers), none of ZeRO 2's
        # per-microbatch collectives, which every replica must issue in the same order
        local_w = self._split is not None and self._split.store is not None and self._reduce is None
        self._weight_order = [a.microbatch for a in self.actions if a.kind is K.BACKWARD_WEIGHT] if local_w else []
        if self._reduce is not None and self._split is not None and self._split.store is not None:
            self._split.store.after_grad = self._reduce.grad_ready
        self.step_in_progress: int | None = None
        self.actions_done = 0
        """Schedule actions completed since the runtime opened: the data-plane progress heartbeats carry."""

    def run_step(self, step: int, microbatches: Sequence[Microbatch] | None = None) -> StepReport:
        """Run every action of this stage for ``step``; return its timings, loss and traffic.

        ``microbatches`` (``m`` pairs of inputs, targets) is needed on the first
        stage (inputs) and the last stage (targets); middle stages pass None.
        """
        self._check_microbatches(microbatches)
        state = StepState(step, microbatches)
        state.loss_scale = None if self.loss_scale is None else self.loss_scale.scale  # fixed for the whole step
        sent_before = self.transport.bytes_sent() if self.transport is not None else {}
        self.memory.start_step()  # before the clocks are read: started_at and t0 must be the same instant
        started_at, t0 = same_instant()
        state.t0 = t0
        self.step_in_progress = step
        posted = 0  # receives of this step posted on their links
        for index, action in enumerate(self.actions):
            try:
                posted = self._post_receives(posted, self._post_before[index], step)
                begin = time.perf_counter()
                category = self._execute(action, state)
            except Exception as exc:  # noqa: BLE001 - re-raised with the grid, keeping GeoschedError classes
                raise self._failure(action, step, exc) from exc
            end = time.perf_counter()
            self.actions_done += 1
            begin = max(begin, state.filled_until)  # prefill chunks run first in this receive's bubble
            name = self._names[index]
            state.events.append(Event(self.stage, name, begin - t0, end - t0, category, action.kind.value))
            if category == "idle":
                state.gaps.append(IdleGap(self.stage, begin - t0, end - t0, name))
        iteration = time.perf_counter() - t0
        sent_after = self.transport.bytes_sent() if self.transport is not None else {}
        traffic = {peer: n - sent_before.get(peer, 0) for peer, n in sent_after.items()}
        loss = sum(state.losses) / len(state.losses) if state.losses else None
        report = StepReport.from_events(
            step=step,
            stage=self.stage,
            replica=self.replica,
            loss=loss,
            iteration_s=iteration,
            started_at=started_at,
            events=state.events,
            idle_gaps=state.gaps,
            bytes_sent=traffic,
            memory=self.memory.report(),
        )
        if self.loss_scale is not None:
            report.loss_scale, report.skipped = state.loss_scale, state.skipped
        report.grad_norm = state.grad_norm
        if self.settings is not None:
            report.lr = self.settings(step)["lr"]
        log.debug(
            "stage %d replica %d step %d: %.1f ms, loss %s", self.stage, self.replica, step, iteration * 1e3, loss
        )
        return report

    def _post_receives(self, posted: int, until: int, step: int) -> int:
        """Post this step's receives ``posted`` .. ``until`` - 1 (``poll`` posts a receive); the new count."""
        if posted < until:
            assert self.transport is not None  # a stage with receives has neighbours
            for peer, kind, mb in self._receives[posted:until]:
                assert mb is not None, "validate() checked every receive"
                self.transport.poll(peer, kind, step, mb)
        return max(posted, until)

    # -- one action ---------------------------------------------------------------------------

    def _execute(self, action: Action, state: StepState) -> str:
        """Run ``action``; return its timeline category."""
        kind, mb = action.kind, action.microbatch
        if kind is K.ALL_REDUCE:
            if self.grad_sync is not None:
                # a StageModel is a StageModule, an nn.Module; the Protocol only names what the runtime calls
                self.grad_sync.allreduce_gradients(self.module)  # type: ignore[arg-type]
        elif kind is K.STEP:
            self._step(state)
            self.optimizer.zero_grad(set_to_none=False)  # keeps grads in the DP group's flat buckets
        else:
            assert mb is not None, f"{action} has no microbatch"  # validate() checked every action
            if kind is K.FORWARD:
                self._forward(mb, state)
            elif kind is K.BACKWARD:
                self._backward(mb, state)
                if self._reduce is not None:
                    self._reduce.backward_done()
            elif kind is K.BACKWARD_INPUT:
                self._backward_input(mb, state)
            elif kind is K.BACKWARD_WEIGHT:
                self._backward_weight(mb, state)
            elif kind is K.RECV_F:
                return self._receive(self.stage - 1, "F", mb, state)
            elif kind is K.RECV_B:
                return self._receive(self.stage + 1, "B", mb, state)
            elif kind is K.SEND_F:
                self._send(state.outputs[mb].detach(), self.stage + 1, "F", mb, state.step)
            elif kind is K.SEND_B:
                self._send(self._finite_gradient(state.input_grads.pop(mb), state), self.stage - 1, "B", mb, state.step)
        return _CATEGORY[kind]

    def _forward(self, mb: int, state: StepState) -> None:
        if self.module.first:
            x = state.microbatch(mb)[0]  # (b, T) int64 token ids
        else:
            x = state.inputs[mb]  # (b, T, C) received activation, requires_grad
        with self.memory.saving():
            out = self.module(x)  # (b, T, C), or logits (b, T, V) on the last stage
            if self.module.last:
                out = self.module.loss(out, state.microbatch(mb)[1])  # scalar
        if self.module.last:
            loss = float(out.detach())
            if not math.isfinite(loss):  # before its backward: no weight takes an update from it
                upstream = not self.module.first and not bool(torch.isfinite(x).all())
                raise TrainingDiverged(
                    f"the loss of microbatch {mb} is {loss}"
                    + (
                        f", and the activation stage {self.stage - 1} sent for it is not finite: training diverged "
                        f"before this stage, or stage {self.stage - 1} sent bad data"
                        if upstream
                        else ": training diverged"
                    )
                    + " (lower job.learning_rate); resume from a checkpoint before this step"
                )
            state.losses.append(loss)
        state.outputs[mb] = out

    def _backward(self, mb: int, state: StepState) -> None:
        out = state.outputs.pop(mb)
        if self.module.last:
            torch.autograd.backward(self._loss_root(out, state))
        else:
            torch.autograd.backward(out, state.output_grads.pop(mb))
        if not self.module.first:
            x = state.inputs.pop(mb)
            assert x.grad is not None, f"stage {self.stage}: no input gradient for microbatch {mb}"
            state.input_grads[mb] = x.grad

    def _loss_root(self, loss: Tensor, state: StepState) -> Tensor:
        """Where the last stage's backward starts: each replica's gradient is the mean over its m
        microbatches, times fp16's loss scale."""
        if state.loss_scale is None:
            return loss / self.num_microbatches
        return loss * (state.loss_scale / self.num_microbatches)

    def _backward_input(self, mb: int, state: StepState) -> None:
        """I: the input gradient only; what W needs stays in ``state.weight_work``. The whole B on the first stage."""
        if self._split is None:  # the first stage: token ids, no input gradient, nothing to split off
            self._backward(mb, state)
            return
        out = state.outputs.pop(mb)
        x = state.inputs.pop(mb)  # (b, T, C), requires_grad
        if self.module.last:
            roots, grads = [self._loss_root(out, state)], None  # as B
        else:
            roots, grads = [out], [state.output_grads.pop(mb)]
        state.input_grads[mb], work = self._split.input(roots, grads, x)  # dx: (b, T, C)
        held = self._split.held_bytes(work)
        state.weight_work[mb] = work, held
        self.memory.hold(held)

    def _backward_weight(self, mb: int, state: StepState) -> None:
        """W: accumulate the weight gradients of microbatch ``mb`` (a no-op on the first stage, whose I did it
        all, and where a receive's wait ran it already: :meth:`_weights_in_wait`)."""
        if mb in state.weights_done:
            return
        state.weights_done.add(mb)
        if self._split is not None:
            work, held = state.weight_work.pop(mb)
            self._split.weight(work)
            self.memory.let_go(held)
        if self._reduce is not None:
            self._reduce.backward_done()

    def _weights_in_wait(self, arrived: Callable[[], bool], state: StepState) -> bool:
        """While the awaited message is not there, run the next W of the schedule whose I has run: the same
        work in the same order (so the gradients accumulate bit for bit as scheduled), earlier, where the
        stage would only wait; its own W action is then a no-op. Whether the receive still waits."""
        while not arrived():
            mb = next((w for w in self._weight_order if w not in state.weights_done), None)
            if mb is None or mb not in state.weight_work:  # every W ran, or the next one's I has not
                return True
            begin = time.perf_counter()
            self._backward_weight(mb, state)
            state.filled_until = end = time.perf_counter()
            name, kind = str(Action(self.stage, K.BACKWARD_WEIGHT, mb)), K.BACKWARD_WEIGHT.value
            state.events.append(Event(self.stage, name, begin - state.t0, end - state.t0, "compute", kind))
        return False

    def _step(self, state: StepState) -> None:
        """STEP: the optimizer step at the step's learning rate, the gradients clipped to the pipeline's
        global norm; in fp16, only if every stage's gradients are finite (the scale updated)."""
        if self.settings is not None:
            apply_settings(self.optimizer, self.settings(state.step))
        if not self.agreement.needed:
            self.optimizer.step()
            return
        module = cast("nn.Module", self.module)
        state.grad_norm = step_together(
            self.optimizer, module, self.agreement, step=state.step, overflowed=state.overflowed
        )
        state.skipped = state.grad_norm is None

    def _receive(self, peer: int, kind: str, mb: int, state: StepState) -> str:
        transport = self.transport
        assert transport is not None
        waited = not transport.poll(peer, kind, state.step, mb)
        if waited and self._weight_order and state.weight_work:
            waited = self._weights_in_wait(lambda: transport.poll(peer, kind, state.step, mb), state)
        begin = time.perf_counter()
        arrived = None
        if waited and self.bubble_filler is not None:
            arrived = self._fill_bubble(peer, kind, mb, state)
        tensor = transport.recv(peer, kind, state.step, mb, timeout=self.recv_timeout_s)
        if waited:  # the next step's bubble forecast: how long this receive waited
            self._last_wait[(kind, mb)] = (arrived or time.perf_counter()) - begin
        if kind == "F":
            state.inputs[mb] = tensor.requires_grad_(True)  # (b, T, C)
        else:
            state.output_grads[mb] = tensor  # (b, T, C)
        return "idle" if waited else "comm"

    def _fill_bubble(self, peer: int, kind: str, mb: int, state: StepState) -> float | None:
        """Run prefill chunks until the awaited message is there; record them as "prefill" events.

        The budget is the wait this receive had last step (None the first time).
        Returns the earliest the message can have arrived if it came during the
        last chunk (the chunk's start: a forecast that never feeds overruns back),
        else None.
        """
        transport = self.transport
        assert transport is not None and self.bubble_filler is not None
        spans = self.bubble_filler.fill(
            lambda: transport.poll(peer, kind, state.step, mb),
            budget_s=self._last_wait.get((kind, mb)),
        )
        for span in spans:
            state.events.append(
                Event(self.stage, "PREFILL", span.start - state.t0, span.end - state.t0, "prefill", "PREFILL")
            )
        if not spans:
            return None
        state.filled_until = spans[-1].end
        return spans[-1].start if transport.poll(peer, kind, state.step, mb) else None

    def _finite_gradient(self, grad: Tensor, state: StepState) -> Tensor:
        """fp16: an input gradient that overflowed makes the stages skip this step; zeros go in its place (a
        compressed link carries finite values only, and the step is skipped anyway)."""
        if self.loss_scale is None or bool(torch.isfinite(grad).all()):
            return grad
        state.overflowed = True
        return torch.zeros_like(grad)

    def _send(self, tensor: Tensor, peer: int, kind: str, mb: int, step: int) -> None:
        assert self.transport is not None
        self.transport.send(tensor, peer, kind, step, mb)

    # -- checks and errors --------------------------------------------------------------------

    def _check_microbatches(self, microbatches: Sequence[Microbatch] | None) -> None:
        if not (self.module.first or self.module.last):
            return
        if microbatches is None or len(microbatches) != self.num_microbatches:
            got = "none" if microbatches is None else str(len(microbatches))
            raise StageError(
                f"stage {self.stage} needs {self.num_microbatches} microbatches of (inputs, targets) per step, "
                f"got {got}; feed it from the data Prefetcher with the plan's microbatch count"
            )

    def _failure(self, action: Action, step: int, exc: Exception) -> GeoschedError:
        """The error to raise for ``exc`` in ``action``: same GeoschedError class, grid appended."""
        try:
            grid = render_grid(self.schedule, mark=action)
        except Exception as render_exc:  # noqa: BLE001 - a broken view must not hide the real error
            grid = f"(grid unavailable: {render_exc})"
        lines = [line.strip() for line in (str(exc) or repr(exc)).splitlines() if line.strip()] or [repr(exc)]
        message = (  # the cause's first line on the first (a torch error may begin with an empty one)
            f"stage {self.stage} replica {self.replica} step {step}: action {action} failed: {lines[0]}\n"
            + "".join(f"{line}\n" for line in lines[1:])
            + f"schedule {self.schedule.name!r} with the failing action marked:\n{grid}"
        )
        log.error("%s", message)
        cls = type(exc) if isinstance(exc, GeoschedError) else StageError
        try:
            return cls(message)
        except TypeError:  # a subclass with a different constructor
            return StageError(message)
