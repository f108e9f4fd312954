"""The prefill protocol: requests and responses as a msgpack header frame plus raw frames (geosched.wire).

A client (ZeroMQ DEALER) sends ``[header, prompt]`` to an agent's prefill
endpoint (ROUTER); the agent answers ``[header, kv]``: one raw frame holds the
K and V tensors of every layer back to back (K0, V0, K1, V1, ...), so a
response is two frames whatever the depth (version 1 sent one frame per
tensor: 2L sends and 2L views per answer, most of the service thread's time).
Every request gets exactly one response. Nothing is unpickled; headers are
decoded with wire's strict msgpack limits and unknown fields are refused.

Request header:

===============  ========  ====================================================
``v``            int       protocol version, 2
``id``           str       caller's request id (1-64 characters), echoed back
``prompt``       str       ``"text"``: the prompt frame is UTF-8, one token per
                           byte (vocab 256); ``"tokens"``: little-endian int64 ids
``deadline_ms``  number    optional: answer within this many ms of arrival
``priority``     int       optional, 0-9 (default 0); higher runs first
``return_kv``    bool      optional (default true): send the KV cache back
``top_k``        int       optional, 1-16 (default 5): logits returned
``token``        str       shared secret, when the agent requires one
===============  ========  ====================================================

Response header: ``v``, ``id`` (None if the request had none readable),
``status`` (``ok`` | ``rejected`` | ``expired`` | ``error``), ``reason`` (not
ok), and when ok: ``prompt_tokens``, ``first_token``, ``topk_ids``,
``topk_logits``, ``kv_layers`` (L; 0 without KV, and then no kv frame), ``kv_dtype``,
``kv_shape`` (each of the 2L tensors in the kv frame: (1, heads, prompt_tokens, hidden/heads)), and the
timings ``queued_ms``, ``compute_ms``, ``ttft_ms``, ``chunks``,
``bubble_share`` (share of compute time spent inside training bubbles).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from geosched import wire
from geosched.errors import InputError, ProtocolError
from geosched.model import KVCache
from geosched.text import printable

VERSION = 2
STATUSES = ("ok", "rejected", "expired", "error")
MAX_ID_CHARS = 64
MAX_TOP_K = 16
MAX_DEADLINE_MS = 86_400_000  # a day: a prefill waits for bubbles, not for ever
MAX_REASON_CHARS = 240  # fits wire.MAX_HEADER_STR
REQUEST_FIELDS = frozenset({"v", "id", "prompt", "deadline_ms", "priority", "return_kv", "top_k", "token"})
TIMING_FIELDS = ("queued_ms", "compute_ms", "ttft_ms", "chunks", "bubble_share")


def numbered_timings(values: dict[str, Any]) -> dict[str, float]:
    """A response's timings as numbers: ``chunks`` a count (the wire may carry it as 1.0), the rest floats;
    ProtocolError for one that is no finite number."""
    out: dict[str, float] = {}
    for key, value in values.items():
        number = float(value)
        if not math.isfinite(number):
            raise ProtocolError(f"timing {str(key)[:40]!r} is {number}, not a finite number")
        out[key] = int(number) if key == "chunks" else number
    return out


class BadRequest(ProtocolError):
    """A request that cannot be served; ``request_id`` is its id when it could be read."""

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        super().__init__(reason)
        self.request_id = request_id


@dataclass
class PrefillRequest:
    """One prompt to prefill."""

    id: str
    tokens: torch.Tensor  # (T,) int64 token ids
    deadline_s: float | None = None  # seconds from arrival
    priority: int = 0
    return_kv: bool = True
    top_k: int = 5
    auth_token: str | None = None


@dataclass
class PrefillResponse:
    """The answer to one request: status, first token, top-k logits, KV cache and timings."""

    id: str | None
    status: str
    reason: str = ""
    prompt_tokens: int = 0
    first_token: int | None = None
    topk_ids: list[int] = field(default_factory=list)
    topk_logits: list[float] = field(default_factory=list)
    kv: KVCache | None = None  # per layer (K, V), each (1, H, T, D)
    timings: dict[str, float] = field(default_factory=dict)
    weights_step: int | None = None  # the checkpoint step of the weights that computed it (None: not a step's)


def prompt_tokens(prompt: str | bytes | Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Token ids (T,) int64 of a prompt: text/bytes are byte tokens, ints and tensors are ids."""
    if isinstance(prompt, str):
        try:
            prompt = prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate
            raise InputError(f"prompt: not valid Unicode ({exc.reason} at character {exc.start})") from None
    if isinstance(prompt, (bytes, bytearray)):
        return torch.tensor(list(prompt), dtype=torch.int64)
    return torch.as_tensor(prompt, dtype=torch.int64).reshape(-1).clone()


def token_matches(expected: str | None, offered: str | None) -> bool:
    """Whether ``offered`` is the ``expected`` token, compared in constant time; always true without one."""
    if expected is None:
        return True
    try:
        given = (offered or "").encode()
    except UnicodeEncodeError:  # a lone surrogate from a header's undecodable bytes: no token of ours
        return False
    return hmac.compare_digest(given, expected.encode())


def encode_request(req: PrefillRequest) -> list[bytes | memoryview]:
    """Frames of a request: header and the prompt as int64 token ids."""
    header: dict[str, Any] = {
        "v": VERSION,
        "id": req.id,
        "prompt": "tokens",
        "priority": req.priority,
        "return_kv": req.return_kv,
        "top_k": req.top_k,
    }
    if req.deadline_s is not None:
        header["deadline_ms"] = req.deadline_s * 1e3
    if req.auth_token is not None:
        header["token"] = req.auth_token
    ids = req.tokens.to(torch.int64).contiguous().numpy().astype("<i8", copy=False)
    return [wire.encode_header(header), ids.tobytes()]


def _optional(header: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, rid: str) -> Any:
    if key not in header:
        return default
    value = header[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise BadRequest(f"field {key!r} must be {names} (got {type(value).__name__})", rid)
    return value


def read_request_id(frames: Sequence[bytes]) -> str | None:
    """The request's id if its header is readable, else None (to address an error response)."""
    try:
        header = wire.decode_header(frames[0])
    except (ProtocolError, IndexError):
        return None
    rid = header.get("id")
    return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else None


def decode_request(frames: Sequence[bytes], *, max_prompt_tokens: int, vocab: int) -> PrefillRequest:
    """Validate and decode request frames; BadRequest naming the problem (and the id when known)."""
    if len(frames) != 2:
        raise BadRequest(f"a request is 2 frames (header, prompt), got {len(frames)}", read_request_id(frames[:1]))
    try:
        header = wire.decode_header(frames[0])
    except ProtocolError as exc:
        raise BadRequest(str(exc)) from None
    rid = read_request_id(frames[:1])
    if rid is None:
        raise BadRequest(f"field 'id' must be a string of 1-{MAX_ID_CHARS} characters")
    unknown = sorted(set(header) - REQUEST_FIELDS)
    if unknown:
        raise BadRequest(f"unknown fields {unknown[:4]}; known: {sorted(REQUEST_FIELDS)}", rid)
    if header.get("v") != VERSION:
        raise BadRequest(
            f"field 'v' must be {VERSION} (got {wire.show(header.get('v'))}); a version 1 client expects one "
            f"frame per KV tensor: upgrade it",
            rid,
        )
    kind = header.get("prompt")
    if kind not in ("text", "tokens"):
        raise BadRequest(f"field 'prompt' must be 'text' or 'tokens' (got {wire.show(kind)})", rid)
    deadline = _optional(header, "deadline_ms", (int, float), None, rid)
    if deadline is not None and not (math.isfinite(deadline) and 0 < deadline <= MAX_DEADLINE_MS):
        raise BadRequest(f"field 'deadline_ms' must be > 0 and <= {MAX_DEADLINE_MS} (a day; got {deadline})", rid)
    priority = _optional(header, "priority", int, 0, rid)
    if not 0 <= priority <= 9:
        raise BadRequest(f"field 'priority' must be 0-9 (got {priority})", rid)
    top_k = _optional(header, "top_k", int, 5, rid)
    if not 1 <= top_k <= min(MAX_TOP_K, vocab):
        raise BadRequest(f"field 'top_k' must be 1-{min(MAX_TOP_K, vocab)} (got {top_k})", rid)
    return_kv = _optional(header, "return_kv", bool, True, rid)
    auth = _optional(header, "token", str, None, rid)
    data = frames[1]
    width = 1 if kind == "text" else 8
    if len(data) % width:
        raise BadRequest(f"token prompt is {len(data)} bytes, not a multiple of 8 (little-endian int64 ids)", rid)
    count = len(data) // width
    if count == 0:
        raise BadRequest("prompt is empty; send at least one token", rid)
    if count > max_prompt_tokens:
        raise BadRequest(
            f"prompt of {count} tokens exceeds the prefill service's limit of {max_prompt_tokens}; shorten it", rid
        )
    if kind == "text":
        tokens = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    else:
        tokens = torch.from_numpy(np.frombuffer(data, dtype="<i8").astype(np.int64))
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise BadRequest(f"token ids must be in [0, {vocab}) (got {int(tokens.min())}..{int(tokens.max())})", rid)
    return PrefillRequest(rid, tokens, None if deadline is None else deadline / 1e3, priority, return_kv, top_k, auth)


def encode_response(resp: PrefillResponse) -> list[bytes | memoryview]:
    """Frames of a response: header, then one frame of K and V of every layer when the cache is sent."""
    if resp.status not in STATUSES:
        raise ValueError(f"status {resp.status!r} not in {STATUSES}")
    header: dict[str, Any] = {"v": VERSION, "id": resp.id, "status": resp.status}
    if resp.status != "ok":
        header["reason"] = resp.reason[:MAX_REASON_CHARS]
        return [wire.encode_header(header)]
    kv = resp.kv or []
    header.update(
        prompt_tokens=resp.prompt_tokens,
        first_token=resp.first_token,
        topk_ids=list(resp.topk_ids),
        topk_logits=[float(x) for x in resp.topk_logits],
        kv_layers=len(kv),
    )
    if resp.weights_step is not None:
        header["weights_step"] = resp.weights_step
    header.update({k: float(resp.timings.get(k, 0.0)) for k in TIMING_FIELDS})
    if not kv:
        return [wire.encode_header(header)]
    header["kv_dtype"] = wire.dtype_to_name(kv[0][0].dtype)
    header["kv_shape"] = list(kv[0][0].shape)
    stacked = torch.stack([t for pair in kv for t in pair]).cpu()  # (2L, 1, H, T, D): one copy, one send
    return [wire.encode_header(header), wire.tensor_bytes(stacked)]


def top_k_lists(ids: Any, logits: Any) -> tuple[list[int], list[float]]:
    """A response's ``topk_ids`` and ``topk_logits`` as sent: lists of at most :data:`MAX_TOP_K` token ids (ints)
    and numbers; ProtocolError for anything else (a hostile server's ``["x"]``, ``[inf]``, a nested list)."""
    if not isinstance(ids, list) or not isinstance(logits, list) or not len(ids) == len(logits) <= MAX_TOP_K:
        raise ProtocolError(f"topk_ids and topk_logits must be two lists of at most {MAX_TOP_K} numbers alike long")
    if not all(type(i) is int and 0 <= i < 1 << 31 for i in ids):
        raise ProtocolError("topk_ids must be token ids (integers from 0)")
    if not all(type(x) in (int, float) for x in logits):
        raise ProtocolError("topk_logits must be numbers")
    return list(ids), [float(x) for x in logits]


def decode_response(frames: Sequence[bytes | memoryview], *, max_kv_frame_bytes: int) -> PrefillResponse:
    """Validate and decode response frames; ProtocolError for anything malformed."""
    if not frames:
        raise ProtocolError("empty response")
    header = wire.decode_header(frames[0])
    status = header.get("status")
    if status not in STATUSES:
        raise ProtocolError(f"response status {wire.show(status)} not in {STATUSES}")
    rid = header.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("response id must be a string or nil")
    if status != "ok":  # a server's words, shown on a terminal: no escape sequence of its gets there
        return PrefillResponse(rid, status, reason=printable(header.get("reason", ""), MAX_REASON_CHARS))
    layers = wire.require_int(header, "kv_layers", 0, 1 << 16)
    kv: KVCache | None = None
    if len(frames) != 1 + (layers > 0):
        raise ProtocolError(
            f"response announces {layers} KV layers but carries {len(frames) - 1} frames after the header "
            f"(expected {int(layers > 0)})"
        )
    if layers:
        dtype = wire.dtype_from_name(wire.require(header, "kv_dtype", str))
        shape = [2 * layers, *wire.require_shape(header, "kv_shape")]
        wire.check_tensor_spec(dtype, shape, max_bytes=max_kv_frame_bytes)
        stacked = wire.tensor_from_buffer(frames[1], dtype, shape)  # (2L, 1, H, T, D)
        kv = [(stacked[2 * i], stacked[2 * i + 1]) for i in range(layers)]
    topk_ids, topk_logits = top_k_lists(header.get("topk_ids"), header.get("topk_logits"))
    timings = numbered_timings({k: wire.require(header, k, (int, float)) for k in TIMING_FIELDS})
    return PrefillResponse(
        rid,
        status,
        prompt_tokens=wire.require_int(header, "prompt_tokens"),
        first_token=wire.require_int(header, "first_token"),
        topk_ids=topk_ids,
        topk_logits=topk_logits,
        kv=kv,
        timings=timings,
        weights_step=wire.require_int(header, "weights_step") if "weights_step" in header else None,
    )
