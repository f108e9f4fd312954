"""Parameter and FLOP counts of the geosched GPT model, without importing torch.

The cost model and the planner use these to size stages; the model tests check
the parameter counts against the real ``torch`` modules of
:mod:`geosched.model`. Every function takes any object with the attributes
``layers, hidden, heads, seq_len, vocab`` and optionally ``ffn_mult`` (MLP
width / hidden, default 4): a ``ModelShape`` or the config's ``ModelSpec``.

FLOPs count a multiply-add as 2 FLOPs. The per-block formula is the one of
Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", sec. 5.1) and Kaplan et al. 2020 ("Scaling Laws
for Neural Language Models", table 1): the forward pass of one transformer
block over a microbatch of ``B`` sequences of ``T`` tokens with hidden size
``C`` costs

    24 * B*T*C^2      (QKV 6BTC^2 + attention output 2BTC^2 + MLP 16BTC^2)
  +  4 * B*T^2*C      (scores Q K^T 2BT^2C + weighted sum A V 2BT^2C)

(with an MLP of width ``f*C`` the MLP term is ``4f*BTC^2``, so ``(8 + 4f) BTC^2``)

and the LM head costs ``2 * B*T*C*V``. The causal mask is not discounted (as
in both papers). The backward pass costs twice the forward
(:data:`BACKWARD_FLOPS_PER_FORWARD`); small terms (LayerNorm, GELU, softmax,
biases, embedding lookups) are left out.
"""

from __future__ import annotations

from typing import Protocol

BACKWARD_FLOPS_PER_FORWARD = 2.0
"""Backward FLOPs / forward FLOPs for a transformer block or the head."""
DEFAULT_FFN_MULT = 4
"""MLP width as a multiple of hidden when the shape does not say."""


class ShapeLike(Protocol):
    """Anything with the five model-shape integers (ModelShape, config ModelSpec); read-only."""

    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def vocab(self) -> int: ...


def ffn_mult(shape: ShapeLike) -> int:
    """The shape's MLP width multiple (``ffn_mult`` attribute, default 4)."""
    return int(getattr(shape, "ffn_mult", DEFAULT_FFN_MULT))


def layer_params(shape: ShapeLike) -> int:
    """Parameters of one block: QKV + output projection, f x MLP, two LayerNorms (with biases)."""
    c, f = shape.hidden, ffn_mult(shape)
    attention = (c * 3 * c + 3 * c) + (c * c + c)
    mlp = (c * f * c + f * c) + (f * c * c + c)
    norms = 2 * (2 * c)
    return attention + mlp + norms  # = (4 + 2f) C^2 + (9 + f) C; 12 C^2 + 13 C for f = 4


def embedding_params(shape: ShapeLike) -> int:
    """Parameters of the first stage's token and learned position embeddings."""
    return shape.vocab * shape.hidden + shape.seq_len * shape.hidden


def head_params(shape: ShapeLike) -> int:
    """Parameters of the last stage's final LayerNorm and untied LM head (no bias)."""
    return 2 * shape.hidden + shape.hidden * shape.vocab


def stage_params(shape: ShapeLike, layer_start: int, layer_end: int, *, first: bool, last: bool) -> int:
    """Parameters held by the stage with blocks ``[layer_start, layer_end)``."""
    total = (layer_end - layer_start) * layer_params(shape)
    if first:
        total += embedding_params(shape)
    if last:
        total += head_params(shape)
    return total


def total_params(shape: ShapeLike) -> int:
    """Parameters of the whole model."""
    return stage_params(shape, 0, shape.layers, first=True, last=True)


def block_forward_flops_per_token(shape: ShapeLike, context: int | None = None) -> int:
    """Forward FLOPs of one block per token: ``24 C^2 + 4 T C`` (Narayanan et al. 2021).

    ``context`` is the attended sequence length ``T`` (default: ``shape.seq_len``).
    Multiplied by ``B*T`` tokens this is ``24 B T C^2 + 4 B T^2 C``; with an
    MLP of width ``f*C`` the first term is ``(8 + 4f) C^2``.
    """
    t = shape.seq_len if context is None else context
    c = shape.hidden
    return (8 + 4 * ffn_mult(shape)) * c * c + 4 * t * c


def head_forward_flops_per_token(shape: ShapeLike) -> int:
    """Forward FLOPs of the LM head per token: ``2 C V``."""
    return 2 * shape.hidden * shape.vocab


def stage_forward_flops_per_token(
    shape: ShapeLike, layer_start: int, layer_end: int, *, last: bool, context: int | None = None
) -> int:
    """Forward FLOPs per token of the stage with blocks ``[layer_start, layer_end)`` (+ head if last)."""
    flops = (layer_end - layer_start) * block_forward_flops_per_token(shape, context)
    if last:
        flops += head_forward_flops_per_token(shape)
    return flops
