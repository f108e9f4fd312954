"""A GPT-style decoder-only transformer that can be cut into pipeline stages.

Byte-level tokens (vocab 256), token + learned position embeddings, pre-LN
blocks of causal self-attention and a GELU MLP (4x hidden by default), final LayerNorm, untied LM
head, cross-entropy loss. :func:`build_stage` builds the part of the model
holding blocks ``[layer_start, layer_end)``:

- the first stage also holds the embeddings: token ids (B, T) int64 -> (B, T, C);
- a middle stage maps hidden states (B, T, C) -> (B, T, C);
- the last stage also holds the final norm and head: (B, T, C) -> logits (B, T, V),
  and ``stage.loss(logits, targets)`` gives the scalar mean cross-entropy.

Parameter names are global (``blocks.3.attn.qkv.weight`` keeps its layer index
on whichever stage holds it), and every parameter is initialised from its own
generator seeded by ``(seed, name)``: however the model is cut, the stages
start from exactly the weights of the one-process model.

Inference (prefill-as-a-service): ``stage.forward_cached(x, kv_cache, start_pos)``
runs a chunk of new tokens against a per-layer (K, V) cache and returns the
grown cache; :func:`prefill`, :func:`decode_step` and :func:`greedy_generate`
drive a whole model (one stage, or a chain of stages) with it.

Example::

    shape = ModelShape(layers=4, hidden=32, heads=4, seq_len=32)
    s0 = build_stage(shape, 0, 2, first=True, last=False, seed=1)
    s1 = build_stage(shape, 2, 4, first=False, last=True, seed=1)
    loss = s1.loss(s1(s0(tokens)), targets)   # == build_model(shape, 1) loss
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geosched.errors import InputError
from geosched.model_counts import (  # re-exported: one import site for model users
    BACKWARD_FLOPS_PER_FORWARD,
    ShapeLike,
    block_forward_flops_per_token,
    embedding_params,
    ffn_mult,
    head_forward_flops_per_token,
    head_params,
    layer_params,
    stage_forward_flops_per_token,
    stage_params,
    total_params,
)

__all__ = [
    "BACKWARD_FLOPS_PER_FORWARD",
    "KV",
    "KVCache",
    "ModelShape",
    "PRECISION_DTYPES",
    "StageModule",
    "block_forward_flops_per_token",
    "build_model",
    "build_stage",
    "decode_step",
    "embedding_params",
    "ffn_mult",
    "greedy_generate",
    "head_forward_flops_per_token",
    "head_params",
    "layer_params",
    "prefill",
    "stage_forward_flops_per_token",
    "stage_params",
    "total_params",
]

log = logging.getLogger(__name__)

KV = tuple[Tensor, Tensor]
"""Cached keys and values of one layer, each (B, H, T_cached, C // H)."""
KVCache = list[KV]
"""One :data:`KV` per block held, in layer order."""

PRECISION_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The torch dtype of each config ``job.precision``."""

INIT_STD = 0.02
"""Std of the normal init of Linear and Embedding weights (GPT-2)."""


@dataclass(frozen=True)
class ModelShape:
    """The five integers that fix the model's architecture."""

    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Hidden size C (a multiple of ``heads``)."""
    heads: int
    """Attention heads per block."""
    seq_len: int
    """Maximum sequence length (size of the position embedding)."""
    vocab: int = 256
    """Vocabulary size; 256 = raw bytes, no tokenizer."""
    ffn_mult: int = 4
    """MLP width as a multiple of hidden."""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "seq_len", "vocab", "ffn_mult"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"model.{field}: must be an integer >= 1 (got {value!r})")
        if self.hidden % self.heads:
            raise InputError(
                f"model.hidden({self.hidden}) must be divisible by model.heads({self.heads}); "
                f"pick a hidden size that is a multiple of heads"
            )

    @classmethod
    def of(cls, spec: ShapeLike) -> ModelShape:
        """A ModelShape from any object with the five attributes (and optionally ``ffn_mult``)."""
        if isinstance(spec, ModelShape):
            return spec
        if getattr(spec, "custom_layers", ()):
            raise InputError(
                "model.custom_layers only describes costs for planning; a model that is trained needs "
                "the GPT shape alone (remove custom_layers)"
            )
        return cls(
            layers=spec.layers,
            hidden=spec.hidden,
            heads=spec.heads,
            seq_len=spec.seq_len,
            vocab=spec.vocab,
            ffn_mult=ffn_mult(spec),
        )


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: a stable hash of ``(seed, name)``."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ResidualProjection(nn.Linear):
    """A linear layer that writes into the residual stream: its weights start smaller (see _init_parameters)."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention that can extend a (K, V) cache."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.heads = shape.heads
        """Heads this module computes; tensor parallelism lowers it to the heads of its shard."""
        self.head_dim = shape.hidden // shape.heads
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.proj = ResidualProjection(shape.hidden, shape.hidden)

    def forward(self, x: Tensor, past: KV | None = None) -> tuple[Tensor, KV]:
        """Attend the T new positions of ``x`` to ``past`` and themselves; return output and grown KV."""
        B, T, _ = x.shape
        H, D = self.heads, self.head_dim
        q, k, v = self.qkv(x).split(H * D, dim=2)  # 3 x (B, T, H*D); H*D = C unless sharded
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        if past is not None:
            assert past[0].shape[:2] == (B, H), "KV cache batch/heads mismatch"
            k = torch.cat([past[0], k], dim=2)  # (B, H, P+T, D)
            v = torch.cat([past[1], v], dim=2)  # (B, H, P+T, D)
        P = k.size(2) - T  # positions already cached
        if P == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        elif T == 1:
            y = F.scaled_dot_product_attention(q, k, v)  # the one new token sees everything: (B, H, 1, D)
        else:
            # new token i sits at position P+i and sees keys 0..P+i (is_causal would align top-left)
            mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(diagonal=P)  # (T, P+T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, H * D)  # (B, T, H*D)
        return self.proj(y), (k, v)


class MLP(nn.Module):
    """The block's feed-forward part: C -> fC -> GELU -> C (f = ffn_mult, 4 by default)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.fc = nn.Linear(shape.hidden, shape.ffn_mult * shape.hidden)
        self.proj = ResidualProjection(shape.ffn_mult * shape.hidden, shape.hidden)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        out: Tensor = self.proj(F.gelu(self.fc(x)))  # (B, T, fC) -> (B, T, C)
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.hidden)
        self.attn = CausalSelfAttention(shape)
        self.ln_2 = nn.LayerNorm(shape.hidden)
        self.mlp = MLP(shape)

    def forward(self, x: Tensor, past: KV | None = None) -> tuple[Tensor, KV]:
        """(B, T, C) -> (B, T, C), and this layer's grown KV."""
        x, kv = self.attend(x, past)
        return self.feed_forward(x), kv

    def attend(self, x: Tensor, past: KV | None = None) -> tuple[Tensor, KV]:
        """The first half: x + attn(ln_1(x)) (B, T, C), and this layer's grown KV."""
        a, kv = self.attn(self.ln_1(x), past)
        return x + a, kv

    def feed_forward(self, x: Tensor) -> Tensor:
        """The second half: x + mlp(ln_2(x)) (B, T, C)."""
        return x + self.mlp(self.ln_2(x))


class StageModule(nn.Module):
    """The blocks ``[layer_start, layer_end)`` of the model, plus embeddings if first, head if last."""

    def __init__(self, shape: ModelShape, layer_start: int, layer_end: int, *, first: bool, last: bool) -> None:
        super().__init__()
        if not 0 <= layer_start <= layer_end <= shape.layers:
            raise InputError(
                f"stage layers [{layer_start}, {layer_end}) are not inside the model's 0..{shape.layers} layers"
            )
        if layer_start == layer_end and not (first or last):
            raise InputError(f"stage [{layer_start}, {layer_end}) holds no layers, embeddings or head")
        self.shape = shape
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.first = first
        self.last = last
        if first:
            self.tok_emb = nn.Embedding(shape.vocab, shape.hidden)
            self.pos_emb = nn.Embedding(shape.seq_len, shape.hidden)
        self.blocks = nn.ModuleDict({str(i): Block(shape) for i in range(layer_start, layer_end)})
        if last:
            self.ln_f = nn.LayerNorm(shape.hidden)
            self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def __repr__(self) -> str:
        return (
            f"StageModule(layers=[{self.layer_start}, {self.layer_end}), first={self.first}, "
            f"last={self.last}, params={sum(p.numel() for p in self.parameters())})"
        )

    recompute = False
    """Full activation recomputation (``job.recompute: full``): with grad enabled, :meth:`forward` keeps only each
    block's input and its backward runs the block again (``torch.utils.checkpoint``, non-reentrant), as
    Megatron's full recomputation does; the gradients are the same."""

    def forward(self, x: Tensor) -> Tensor:
        """Training forward: tokens (B, T) or hidden (B, T, C) -> hidden (B, T, C) or logits (B, T, V)."""
        if not (self.recompute and torch.is_grad_enabled()):
            out, _ = self.forward_cached(x)
            return out
        from torch.utils.checkpoint import checkpoint

        h = self._embedded(x, None, 0)
        for block in cast("Iterable[Block]", self.blocks.values()):
            h = checkpoint(_block_output, block, h, use_reentrant=False)
        return self._output(h)

    def forward_cached(self, x: Tensor, kv_cache: KVCache | None = None, start_pos: int = 0) -> tuple[Tensor, KVCache]:
        """Run T new positions starting at ``start_pos`` against ``kv_cache`` (one KV per block held).

        Returns this stage's output for the new positions and the grown cache
        (a new list; the given one is not modified).
        """
        steps = self.forward_cached_steps(x, kv_cache, start_pos)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result: tuple[Tensor, KVCache] = done.value
                return result

    @property
    def cached_pieces(self) -> int:
        """The stretches :meth:`forward_cached_steps` runs between two chances to stop: each half block, then
        the head (which runs with the last ``next``)."""
        return 2 * len(self.blocks) + 1

    def forward_cached_steps(
        self, x: Tensor, kv_cache: KVCache | None = None, start_pos: int = 0
    ) -> Generator[int, None, tuple[Tensor, KVCache]]:
        """:meth:`forward_cached` half a block at a time: yields a block's index after its attention and again
        after its MLP, returns ``(output, grown cache)``. A caller may stop at any yield and resume later (a
        prefill chunk that gives its core back to training mid-chunk); grad mode is the caller's at each
        ``next``."""
        h = self._embedded(x, kv_cache, start_pos)  # (B, T, C)
        new_cache: KVCache = []
        for i, block in enumerate(cast("Iterable[Block]", self.blocks.values())):
            h, kv = block.attend(h, None if kv_cache is None else kv_cache[i])  # (B, T, C)
            yield i
            h = block.feed_forward(h)  # (B, T, C)
            new_cache.append(kv)
            yield i
        return self._output(h), new_cache

    def _embedded(self, x: Tensor, kv_cache: KVCache | None, start_pos: int) -> Tensor:
        """The first block's input (B, T, C): the embedded tokens on the first stage, else ``x``; checked."""
        if self.first:
            assert x.dim() == 2 and x.dtype == torch.int64, f"first stage takes (B, T) tokens, got {x.dtype}"
        else:
            assert x.dim() == 3 and x.size(-1) == self.shape.hidden, f"stage takes (B, T, C), got {tuple(x.shape)}"
        T = x.shape[1]
        if kv_cache is not None:
            assert len(kv_cache) == len(self.blocks), f"KV cache of {len(kv_cache)} layers for {len(self.blocks)}"
            assert all(k.size(2) == start_pos for k, _ in kv_cache), "start_pos must equal the cached length"
        if start_pos + T > self.shape.seq_len:
            raise InputError(
                f"sequence of {start_pos + T} tokens exceeds the model's seq_len {self.shape.seq_len}; "
                f"shorten the prompt or the generation"
            )
        if not self.first:
            return x
        pos = torch.arange(start_pos, start_pos + T, device=x.device)  # (T,)
        return self.tok_emb(x) + self.pos_emb(pos)  # type: ignore[no-any-return]

    def _output(self, h: Tensor) -> Tensor:
        """The stage's output from the last block's (B, T, C): logits (B, T, V) on the last stage, else ``h``."""
        return self.head(self.ln_f(h)) if self.last else h  # type: ignore[no-any-return]

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of logits (B, T, V) against targets (B, T) int64; last stage only."""
        assert self.last, "loss() lives on the last stage"
        assert logits.shape[:2] == targets.shape, f"logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}"
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))  # scalar

    def input_spec(self, batch: int, tokens: int | None = None) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of what this stage receives (for preallocated receive buffers)."""
        t = self.shape.seq_len if tokens is None else tokens
        if self.first:
            return (batch, t), torch.int64
        return (batch, t, self.shape.hidden), self._dtype()

    def output_spec(self, batch: int, tokens: int | None = None) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of what this stage sends on (hidden states; logits if last)."""
        t = self.shape.seq_len if tokens is None else tokens
        return (batch, t, self.shape.vocab if self.last else self.shape.hidden), self._dtype()

    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def _init_parameters(module: nn.Module, seed: int, layers: int) -> None:
    """Initialise every parameter from its own generator seeded by (seed, global name)."""
    residual_std = INIT_STD / math.sqrt(2 * layers)  # GPT-2: scale residual projections by depth
    with torch.no_grad():
        for module_name, sub in module.named_modules():
            for leaf, param in sub.named_parameters(recurse=False):
                name = f"{module_name}.{leaf}" if module_name else leaf
                if isinstance(sub, nn.LayerNorm):
                    param.fill_(1.0 if leaf == "weight" else 0.0)
                elif leaf == "bias":
                    param.zero_()
                else:
                    std = residual_std if isinstance(sub, ResidualProjection) else INIT_STD
                    gen = torch.Generator().manual_seed(parameter_seed(seed, name))
                    values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                    param.copy_(values)  # drawn in float32, then cast: same values for every dtype


def _block_output(block: Block, x: Tensor) -> Tensor:
    return block(x)[0]


def build_stage(
    shape: ShapeLike,
    layer_start: int,
    layer_end: int,
    *,
    first: bool,
    last: bool,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> StageModule:
    """Build the stage holding blocks ``[layer_start, layer_end)``, initialised cut-independently."""
    model_shape = ModelShape.of(shape)
    stage = StageModule(model_shape, layer_start, layer_end, first=first, last=last)
    _init_parameters(stage, seed, model_shape.layers)
    stage.to(dtype)
    log.debug("built %r seed=%d dtype=%s", stage, seed, dtype)
    return stage


def build_model(shape: ShapeLike, seed: int = 0, dtype: torch.dtype = torch.float32) -> StageModule:
    """The whole model in one process: the stage that is both first and last."""
    return build_stage(shape, 0, shape.layers, first=True, last=True, seed=seed, dtype=dtype)


def _as_chain(model: StageModule | Sequence[StageModule]) -> list[StageModule]:
    """Stages that together form the whole model, checked to be contiguous."""
    stages = [model] if isinstance(model, StageModule) else list(model)
    assert stages and stages[0].first and stages[-1].last, "need a chain from the first to the last stage"
    for a, b in zip(stages, stages[1:]):
        assert a.layer_end == b.layer_start and not a.last and not b.first, "stages must be contiguous"
    assert stages[-1].layer_end == stages[0].shape.layers, "the chain must end with the model's last layer"
    return stages


def _run_chain(stages: list[StageModule], tokens: Tensor, kv: KVCache | None, start_pos: int) -> tuple[Tensor, KVCache]:
    """Run tokens (B, T) through every stage; kv is the flat per-layer cache of the whole model."""
    x, new_kv = tokens, []
    for stage in stages:
        held = None if kv is None else kv[stage.layer_start : stage.layer_end]
        x, stage_kv = stage.forward_cached(x, held, start_pos)
        new_kv.extend(stage_kv)
    return x, new_kv  # logits (B, T, V), one KV per layer


@torch.no_grad()
def prefill(
    model: StageModule | Sequence[StageModule], tokens: Tensor, *, chunk_size: int | None = None
) -> tuple[Tensor, KVCache]:
    """Prefill a prompt (B, T): logits of its last position (B, V) and the KV cache of every layer.

    With ``chunk_size`` the prompt is processed ``chunk_size`` tokens at a time,
    each chunk appending to the cache (as the prefill service does in bubbles).
    """
    stages = _as_chain(model)
    assert tokens.dim() == 2 and tokens.size(1) >= 1, "prompt must be (B, T) with T >= 1"
    step = tokens.size(1) if chunk_size is None else chunk_size
    assert step >= 1, "chunk_size must be >= 1"
    kv: KVCache | None = None
    logits = tokens.new_empty(0)
    for start in range(0, tokens.size(1), step):
        logits, kv = _run_chain(stages, tokens[:, start : start + step], kv, start)  # (B, t, V)
    assert kv is not None
    return logits[:, -1], kv  # (B, V)


@torch.no_grad()
def decode_step(
    model: StageModule | Sequence[StageModule], token: Tensor, kv: KVCache, pos: int
) -> tuple[Tensor, KVCache]:
    """Feed one token per sequence (B,) at position ``pos``; return its logits (B, V) and the grown cache."""
    stages = _as_chain(model)
    logits, kv = _run_chain(stages, token.view(-1, 1), kv, pos)  # (B, 1, V)
    return logits[:, -1], kv  # (B, V)


@torch.no_grad()
def greedy_generate(
    model: StageModule | Sequence[StageModule],
    prompt: Tensor,
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """Greedy decoding with the KV cache: prompt (B, T0) -> tokens (B, T0 + max_new_tokens)."""
    logits, kv = prefill(model, prompt, chunk_size=chunk_size)  # (B, V)
    out = [prompt]
    pos = prompt.size(1)
    for i in range(max_new_tokens):
        token = logits.argmax(dim=-1)  # (B,)
        out.append(token.view(-1, 1))
        if i + 1 < max_new_tokens:
            logits, kv = decode_step(model, token, kv, pos)
            pos += 1
    return torch.cat(out, dim=1)  # (B, T0 + n)
