"""A prefill service whose weights can be replaced while it serves: new weights take over between requests.

:meth:`SwappablePrefillService.replace_model` hands over a model of the same
shape (e.g. a newer training checkpoint, ``agents.checkpoint.follow``). The
swap happens at once when no prompt is part-way through, else just before the
computing thread picks the next prompt: a prompt's KV cache is never continued
with other weights. Each swap is logged with the label given. Example::

    service = SwappablePrefillService(model, bind="tcp://127.0.0.1:0", served="checkpoint step 4")
    service.replace_model(newer, "checkpoint step 6")   # from any thread
"""

from __future__ import annotations

import logging
from typing import Any

from agents.prefill.jobs import _Job
from agents.prefill.protocol import PrefillResponse
from agents.prefill.service import PrefillService
from geosched.model import StageModule

log = logging.getLogger(__name__)


class SwappablePrefillService(PrefillService):
    """A :class:`~agents.prefill.service.PrefillService` with :meth:`replace_model` (see the module)."""

    def __init__(
        self, model: StageModule, *, served: str = "the given weights", step: int | None = None, **options: Any
    ) -> None:
        super().__init__(model, **options)
        self.served = served
        """What the service computes with now, e.g. ``checkpoint step 6 of ckpt``."""
        self.step = step
        """The checkpoint step of those weights (None: not a step's), told to clients with every answer."""
        self._pending: tuple[StageModule, str, int | None] | None = None

    def replace_model(self, model: StageModule, served: str, step: int | None = None) -> None:
        """Serve ``model`` (same shape and dtype) from the next request on; ``served`` names it in the log,
        ``step`` (its checkpoint step) in the answers."""
        dtype, old_dtype = next(model.parameters()).dtype, next(self.model.parameters()).dtype
        if model.shape != self.shape or not (model.first and model.last) or dtype != old_dtype:
            raise ValueError(f"replacement model {model!r} ({dtype}) differs from the served {self.model!r}")
        model = model.to(next(self.model.parameters()).device)  # where the service computes (a GPU: its stage's)
        with self._lock:
            self._pending = (model, served, step)
        if self._compute.acquire(blocking=False):  # nothing computing: swap now if no prompt is part-way
            try:
                self._swap_between_requests()
            finally:
                self._compute.release()

    def metrics(self) -> dict[str, Any]:
        """The service's metrics, with ``served``: what it computes with now."""
        return {**super().metrics(), "served": self.served}

    def _swap_between_requests(self) -> None:
        """Swap in the pending model unless a prompt is part-way through (the computing thread holds _compute)."""
        with self._lock:
            if self._pending is None or self._current is not None:
                return
            (self.model, self.served, self.step), self._pending = self._pending, None
        log.info("prefill service now serves %s", self.served)

    def _respond(self, identity: Any, response: PrefillResponse, ttft_s: float | None = None) -> None:
        """An answer says the checkpoint step of the weights that computed it (a client decoding on needs them)."""
        if response.status == "ok":
            response.weights_step = self.step  # the model that computed it: a swap waits for no prompt part-way
        super()._respond(identity, response, ttft_s)

    def _next_job(self) -> _Job | None:
        self._swap_between_requests()  # only the computing thread starts a prompt, so none starts in between
        return super()._next_job()
