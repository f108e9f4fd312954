"""The inference model an agent serves prefill with: loaded once from safetensors, its memory counted.

The model is the project's GPT (:mod:`geosched.model`) as one whole
:class:`~geosched.model.StageModule` (first and last), so a prefill runs every
layer on the agent that serves it. Weights are stored with safetensors (no
pickle), under the model's global parameter names. Example::

    model = build_model(shape, seed=1)
    save_inference_weights(model, "/tmp/gpt.safetensors")
    served = load_inference_model(shape, "/tmp/gpt.safetensors")   # or a file from `geosched export`
    nbytes = inference_memory_bytes(shape, max_tokens=shape.seq_len, max_kv_bytes=64 << 20)
"""

from __future__ import annotations

import logging
import os

import torch

from geosched.model import ModelShape, StageModule, build_model, total_params
from geosched.model_counts import ShapeLike
from geosched.weights import load_weights_file

log = logging.getLogger(__name__)


def save_inference_weights(model: StageModule, path: str | os.PathLike[str]) -> None:
    """Write the model's parameters to a safetensors file (contiguous CPU copies)."""
    from safetensors.torch import save_file

    tensors = {name: p.detach().cpu().contiguous() for name, p in model.state_dict().items()}
    save_file(tensors, str(path))


def load_inference_model(
    shape: ShapeLike, weights: str | os.PathLike[str] | None, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> StageModule:
    """The whole model of ``shape`` in eval mode, with weights from a safetensors file.

    ``weights`` None keeps the seeded initial weights (a demo model). Raises
    InputError when the file is missing, unreadable or holds another model
    (:func:`geosched.weights.load_weights_file`).
    """
    if weights is None:
        return frozen(build_model(shape, seed=seed, dtype=dtype), dtype)
    return frozen(load_weights_file(weights, shape, seed=seed, dtype=dtype), dtype)


def frozen(model: StageModule, dtype: torch.dtype = torch.float32) -> StageModule:
    """``model`` ready to serve: cast to ``dtype``, eval mode, no gradients (in place; returned)."""
    model.to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def settle(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (a no-op on the CPU): a piece of a chunk has run when it returns, so
    its time is measured and training, whose kernels queue behind it, waits for one piece at most."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(shape: ShapeLike, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V for one token over every layer: 2 x layers x hidden x itemsize."""
    s = ModelShape.of(shape)
    return 2 * s.layers * s.hidden * dtype.itemsize


def inference_memory_bytes(
    shape: ShapeLike, max_tokens: int, max_kv_bytes: int, dtype: torch.dtype = torch.float32
) -> int:
    """Memory an agent needs to serve prefill: weights + KV budget + one chunk's activations.

    Weights: every parameter once. KV: ``max_kv_bytes`` (the service's bound
    on caches held at once). Activations of one chunk of ``max_tokens``:
    the residual stream, the MLP's wide layer, the attention scores of one
    layer (H x T x T) and the logits, at the given dtype.
    """
    s = ModelShape.of(shape)
    weights = total_params(s) * dtype.itemsize
    activations = max_tokens * (3 * s.hidden + s.ffn_mult * s.hidden + s.vocab) + s.heads * max_tokens * max_tokens
    return int(weights + max_kv_bytes + activations * dtype.itemsize)


class ChunkCostModel:
    """Predicted seconds of a prefill chunk: ``fixed_s + per_token_s x tokens``, adapted to measurements.

    Seeded by timing the real model on a short and a longer chunk; each
    measured chunk then rescales both terms towards what it took (an EMA
    of the ratio measured / predicted), so the model follows contention
    and clock changes while keeping the fixed/per-token split.
    """

    EMA_WEIGHT = 0.3

    def __init__(self, fixed_s: float, per_token_s: float) -> None:
        self.fixed_s = max(0.0, fixed_s)
        self.per_token_s = max(1e-9, per_token_s)

    @classmethod
    def measure(cls, model: StageModule, repeats: int = 3) -> ChunkCostModel:
        """Time chunks of 1 and ``n`` tokens on ``model`` (median of ``repeats``) and fit the two terms."""
        import time

        n = min(16, model.shape.seq_len)
        device = next(model.parameters()).device

        def timed(tokens: int) -> float:
            x = torch.zeros(1, tokens, dtype=torch.int64, device=device)  # (1, t)
            runs = []
            with torch.no_grad():
                model.forward_cached(x)  # warm-up
                settle(device)
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    model.forward_cached(x)
                    settle(device)  # the kernels, not their launch
                    runs.append(time.perf_counter() - t0)
            return sorted(runs)[len(runs) // 2]

        one, many = timed(1), timed(n)
        per_token = max((many - one) / max(1, n - 1), many / n / 4)
        return cls(one - per_token, per_token)

    def seconds(self, tokens: int) -> float:
        """Predicted seconds of a chunk of ``tokens``."""
        return self.fixed_s + self.per_token_s * tokens

    def tokens_for(self, seconds: float) -> int:
        """Most tokens whose chunk is predicted to fit in ``seconds`` (at least 1)."""
        return max(1, int((seconds - self.fixed_s) / self.per_token_s))

    def observe(self, tokens: int, seconds: float) -> None:
        """A chunk of ``tokens`` took ``seconds``: rescale the model towards it."""
        ratio = min(5.0, max(0.2, seconds / max(self.seconds(tokens), 1e-9)))
        factor = 1.0 - self.EMA_WEIGHT + self.EMA_WEIGHT * ratio
        self.fixed_s *= factor
        self.per_token_s *= factor
