"""Deferred weight gradients: a zero-bubble schedule's I and W passes for the price of one backward.

A zero-bubble schedule (ZB-H1, Qi et al. 2023) splits a stage's backward in two: ``I``, the gradient of
the stage's input, which the stage upstream is waiting for, and ``W``, the weight gradients, which nobody
waits for and which the schedule runs later, in what would otherwise be a bubble. torch's
``stage_backward_input`` and ``stage_backward_weight`` split any module by running autograd over the
graph twice (kept alive in between); for the GPT blocks on a CPU the two passes cost about twice one
fused backward (:func:`geosched.profile.measure_backward_split`), which hands the bubble back as compute.

Here the linear layers, which hold nearly all of a block's weights and FLOPs, defer their own weight
gradients instead, as the zero-bubble authors' Megatron implementation does (``WeightGradStore`` in
sail-sg/zero-bubble-pipeline-parallelism): in the one autograd pass of ``I`` a linear layer computes only
``dx = dy W`` and keeps ``(x, dy)``; ``W`` then computes ``dW += dy^T x`` (and ``db += sum(dy)``) for each
pair it kept. Every other parameter (LayerNorms, embeddings) gets its gradient in ``I``, as in a fused
backward, and the gradients are the same ones a fused backward makes (the same two matmuls per layer).

Written by hand because torch has no such switch (its pipelining splits by walking the graph twice), and a
stage built with :func:`geosched.model.build_stage` needs no other change: :func:`defer_weight_gradients`
reroutes its ``nn.Linear`` layers' forwards through :class:`_Forward` (detached weights, a hook on the
output). Layers whose weights are
DTensors (tensor parallelism) are left alone and those stages split with torch's functions: deferred, a
tp 2 stage of the demo got the same gradients but took 28.0-28.6 ms for F + I + W against 27.1-27.5 ms
(DTensor dispatch of W's reshapes and products costs what the second graph walk saves).

Example::

    split = SplitBackward(stage)                   # once, before training
    out = stage(x)                                 # x: (b, T, C), requires_grad
    dx, work = split.input([out], [grad], x)       # I: the linear layers' dW are not computed yet
    ...                                            # send dx upstream, run other microbatches
    split.weight(work)                             # W: accumulate dW, db into .grad
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geosched.optim import gradient_dtype

WeightWork = list[tuple[nn.Linear, Tensor, Tensor]]
"""What W needs of one backward: per linear layer, its input x (..., in) and output gradient dy (..., out)."""


class WeightGradStore:
    """The weight-gradient work the deferred linear layers left behind since the last :meth:`take`."""

    def __init__(self, on_hold: Callable[[int], None] | None = None) -> None:
        self._pending: WeightWork = []
        self.active = False  # forwards record for a deferred W (else the layers run as plain nn.Linear)
        self.after_grad: Callable[[Tensor], None] | None = None
        """Called with each parameter W gave a gradient, as autograd's post-accumulate hooks would be (W sets
        ``.grad`` by hand, which fires none): ZeRO 2 stages it there (:mod:`agents.dp.zero2`)."""
        self.on_hold = on_hold
        """Told the bytes of each layer input a deferring forward keeps for W (autograd does not save it, so
        no saved-tensor hook sees it), and minus them once W used it or its graph was freed unused: the
        memory meter (:mod:`agents.stage.memory`)."""

    def keep(self, layer: nn.Linear, x: Tensor, dy: Tensor) -> None:
        """Called by a deferred layer's backward (on autograd's thread): remember one layer's W work."""
        self._pending.append((layer, x, dy))

    def take(self) -> WeightWork:
        """The work kept since the last call (one backward's, when called after each)."""
        work, self._pending = self._pending, []
        return work

    def run(self, work: WeightWork) -> None:
        """W: accumulate each kept layer's weight (and bias) gradient into its ``.grad``, as autograd would."""
        with torch.no_grad():
            for layer, x, dy in work:
                if self.on_hold is not None:
                    self.on_hold(-x.nbytes)
                dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])  # (N, out), (N, in)
                weight, bias = layer.weight, layer.bias
                if weight.grad is None:
                    weight.grad = (dy2.t() @ x2).to(gradient_dtype(weight))  # (out, in)
                elif weight.grad.dtype == dy2.dtype:
                    weight.grad.addmm_(dy2.t(), x2)  # accumulated in place: no (out, in) temporary
                else:  # fp32 gradients of bf16 weights: the product in bf16, summed in fp32, as autograd does
                    weight.grad.add_(dy2.t() @ x2)
                if bias is not None:
                    if bias.grad is None:
                        bias.grad = dy2.sum(0).to(gradient_dtype(bias))  # (out,)
                    else:
                        bias.grad.add_(dy2.sum(0))
                if self.after_grad is not None:
                    self.after_grad(weight)
                    if bias is not None:
                        self.after_grad(bias)


def defer_weight_gradients(module: nn.Module, on_hold: Callable[[int], None] | None = None) -> WeightGradStore | None:
    """Route ``module``'s ``nn.Linear`` layers through a new store, which defers their weight gradients while
    :attr:`WeightGradStore.active` (decided at forward time: a backward defers what its forward recorded).

    None, and nothing changed, where a linear layer's weight is a DTensor (tensor parallelism).
    """
    layers = [layer for layer in module.modules() if isinstance(layer, nn.Linear)]
    if any(type(layer.weight.data) is not torch.Tensor for layer in layers):
        return None
    store = WeightGradStore(on_hold)
    for layer in layers:
        layer.forward = _Forward(layer, store)  # type: ignore[method-assign,assignment]
    return store


def deferred_layers(module: nn.Module) -> int:
    """How many of ``module``'s linear layers can defer their weight gradients."""
    return sum(isinstance(layer.__dict__.get("forward"), _Forward) for layer in module.modules())


class _Forward:
    """A linear layer's forward while its store may defer.

    Deferring, it runs ``F.linear`` on the *detached* weight and bias, so autograd's backward of the layer
    computes ``dx = dy W`` only, and a hook on the output hands ``(x, dy)`` to the store. Hooks rather than a
    ``torch.autograd.Function``: the Function's Python ``forward``/``backward`` and its context cost about
    twice as much per layer (0.4-0.5 ms a microbatch of the benchmark's stage on a CPU core, against
    0.1-0.3 ms), and the gradients are the same bit for bit.
    """

    def __init__(self, layer: nn.Linear, store: WeightGradStore) -> None:
        self.layer, self.store = layer, store

    def __call__(self, x: Tensor) -> Tensor:
        layer = self.layer
        weight, bias = layer.weight, layer.bias
        if not (self.store.active and torch.is_grad_enabled() and x.requires_grad):
            # a fused backward, inference, or an input autograd does not reach (no dy would come back to W)
            return F.linear(x, weight, bias)
        out = F.linear(x, weight.detach(), None if bias is None else bias.detach())
        x = x.detach()
        if self.store.on_hold is not None:
            self.store.on_hold(x.nbytes)
        out.register_hook(_Keep(self.store, layer, x))
        return out


class _Keep:
    """The hook on a deferring layer's output: hands the layer's input and output gradient to the store."""

    __slots__ = ("kept", "layer", "store", "version", "x")

    def __init__(self, store: WeightGradStore, layer: nn.Linear, x: Tensor) -> None:
        self.store, self.layer, self.x = store, layer, x
        self.version = x._version  # what autograd's saved tensors check: W must see the input the forward saw
        self.kept = False

    def __call__(self, dy: Tensor) -> None:
        if self.x._version != self.version:
            raise RuntimeError(
                f"the input of a deferred {self.layer} was modified in place after its forward; "
                "W would compute a wrong weight gradient"
            )
        self.kept = True
        self.store.keep(self.layer, self.x, dy)

    def __del__(self) -> None:
        # the graph went without a backward through this layer (an abandoned forward): x is no longer held
        if not self.kept and self.store.on_hold is not None:
            self.store.on_hold(-self.x.nbytes)


class SplitBackward:
    """A stage's zero-bubble I and W passes: deferred linear layers where it can, torch's two passes where not.

    While deferring (the default), every forward of the stage records for W, so a stage whose backwards do
    not all split switches it per forward with :meth:`defer` (the profiler times both kinds on one stage).
    """

    def __init__(self, module: nn.Module, on_hold: Callable[[int], None] | None = None) -> None:
        self.module = module
        self.store = defer_weight_gradients(module, on_hold)
        self.defer(True)

    def defer(self, on: bool) -> None:
        """Whether the forwards from now on split their backward (``input`` then ``weight``) or fuse it."""
        if self.store is not None:
            self.store.active = on

    def input(self, roots: list[Tensor], grads: list[Tensor] | None, x: Tensor) -> tuple[Tensor, Any]:
        """I: the gradient of the stage input ``x`` (a leaf that requires grad), and what W will need."""
        if self.store is None:
            from torch.distributed.pipelining._backward import stage_backward_input

            work: Any
            (dx,), work = stage_backward_input(roots, grads, [x], self.module.parameters())
        else:
            torch.autograd.backward(roots, grads)
            dx, work = x.grad, self.store.take()
        assert dx is not None, "no gradient reached the stage input"
        return dx, work

    def held_bytes(self, work: Any) -> int:
        """What I added to keep alive outside autograd until W: the deferred layers' output gradients (their
        inputs have been held since the forward: told to ``on_hold``); 0 for torch's split, whose retained
        graph autograd itself holds."""
        if self.store is None:
            return 0
        return sum(dy.nbytes for _, _, dy in work)

    def weight(self, work: Any) -> None:
        """W: accumulate the weight gradients ``input`` left for later."""
        if self.store is None:
            from torch.distributed.pipelining._backward import stage_backward_weight

            stage_backward_weight(self.module.parameters(), work)
        else:
            self.store.run(work)
