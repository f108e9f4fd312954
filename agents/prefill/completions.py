"""OpenAI-style request and response bodies of the prefill service's HTTP front end: no sockets, no threads.

:func:`parse_request` reads a ``/v1/completions`` or ``/v1/prefill`` JSON
body strictly (:func:`load_json`: UTF-8, one object, no duplicate keys, no
NaN) and turns it into a :class:`~agents.prefill.protocol.PrefillRequest`
through :func:`~agents.prefill.protocol.decode_request`, so both endpoints
enforce one set of limits (prompt length, token ids, priority, deadline).
:func:`completion_body` writes the OpenAI completion object;
:func:`kv_safetensors` / :func:`response_from_safetensors` carry a KV cache
as safetensors bytes. Every refusal is an :class:`HttpError`, whose
:meth:`~HttpError.body` is OpenAI's ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from agents.prefill.protocol import (
    MAX_TOP_K,
    VERSION,
    BadRequest,
    PrefillResponse,
    decode_request,
    numbered_timings,
    top_k_lists,
)
from geosched import wire
from geosched.errors import ProtocolError
from geosched.model import KVCache
from geosched.text import printable

NEUTRAL = {"stop": None, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "best_of": 1}
NEUTRAL |= {"logit_bias": None, "suffix": None, "seed": None}
"""OpenAI's fields that change nothing at their defaults (clients send them): accepted at these values (or
null; ``stop: []`` and ``logit_bias: {}`` too, and any integer ``seed``: the one token is the greedy one)."""
COMPLETION_FIELDS = frozenset(
    {"model", "prompt", "max_tokens", "logprobs", "n", "stream", "echo", "temperature", "user", *NEUTRAL}
    | {"priority", "deadline_ms"}  # geosched's own: the service's queue order and the answer's deadline
)
PREFILL_FIELDS = frozenset({"model", "prompt", "user", "priority", "deadline_ms", "top_k"})
KV_FORMAT = "geosched-prefill-kv/1"
MAX_SAFETENSORS_HEADER = 1 << 20


class HttpError(Exception):
    """A request answered with an HTTP error status and OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> HttpError:
    """A 400 (or ``status``) ``invalid_request_error``."""
    return HttpError(status, message, "invalid_request_error", param, code)


@dataclass
class Ask:
    """A parsed request: what goes to the service, and how to write the answer."""

    request: Any  # PrefillRequest
    prompt_text: str  # the prompt as text (for text_offset)
    logprobs: int | None = None  # completions: top logprobs asked for (None: no logprobs object)


MAX_INT_DIGITS = 20  # 2**64 has 20: the largest integer a field (a seed) takes


def load_json(body: bytes) -> dict[str, Any]:
    """The JSON object in ``body``; HttpError (400) for anything else: not UTF-8, NaN, duplicate keys, not an object."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):
            raise ValueError("duplicate keys in an object")
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text[:40]} is out of range")
        return value

    def integer(text: str) -> int:  # Python's own limit names sys.set_int_max_str_digits(), the server's setting
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise ValueError(f"an integer of {len(text.lstrip('-'))} digits; no field takes more than {MAX_INT_DIGITS}")
        return int(text)

    try:
        hooks: dict[str, Any] = {"parse_constant": constant, "parse_float": number, "parse_int": integer}
        value = json.loads(body.decode("utf-8"), object_pairs_hook=pairs, **hooks)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting
        raise invalid(f"the body is not valid JSON: {str(exc)[:200]}; send one JSON object") from None
    if not isinstance(value, dict):
        raise invalid(f"the body must be a JSON object, not {type(value).__name__}")
    return value


def token_text(token: int) -> str:
    """The text of one byte token (``"\\xc3"`` for a byte that is not UTF-8 alone; ``"<id>"`` beyond bytes)."""
    if token >= 256:
        return f"<{token}>"
    return bytes([token]).decode("utf-8", errors="backslashreplace")


def _prompt_frame(prompt: Any) -> tuple[str, bytes, str]:
    """(kind, frame, text) of a JSON prompt: a string (UTF-8 bytes are the tokens) or a list of token ids."""
    if isinstance(prompt, str):
        try:
            return "text", prompt.encode("utf-8"), prompt
        except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate is not text
            raise invalid(
                "prompt is not valid Unicode (a lone surrogate such as \\ud800); send UTF-8 text", "prompt"
            ) from None
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not -(1 << 63) <= t < 1 << 63 for t in prompt):
            raise invalid("prompt token ids must fit in int64", "prompt")
        ids = np.asarray(prompt, dtype="<i8")
        return "tokens", ids.tobytes(), _tokens_text(prompt)
    raise invalid(
        "prompt must be a string or a list of token ids (one prompt per request; token ids are bytes of UTF-8)",
        "prompt",
    )


def _tokens_text(tokens: list[int]) -> str:
    """Token ids as the text a string prompt of the same bytes is: runs of byte tokens decoded as UTF-8 (so
    ``[195, 169]`` is "é", one character for ``text_offset``, as the string "é" is), others as :func:`token_text`."""
    out, run = [], bytearray()
    for t in [*tokens, -1]:
        if 0 <= t < 256:
            run.append(t)
            continue
        out.append(run.decode("utf-8", errors="backslashreplace"))
        run.clear()
        out.append(token_text(t) if t >= 256 else "")
    return "".join(out)


def _flag(body: dict[str, Any], key: str, allowed: Any, why: str, *, integer: bool = False) -> None:
    value = body.get(key)
    wrong_type = isinstance(value, bool) != isinstance(allowed, bool) or (integer and not isinstance(value, int))
    if value is not None and (value != allowed or wrong_type):  # an integer field's 1.0 is no 1 (OpenAI's schema)
        raise invalid(f"{key} must be {json.dumps(allowed)}: {why}", key, "unsupported_value")  # not true for 1


def parse_request(body: dict[str, Any], *, kind: str, model_id: str, max_prompt_tokens: int, vocab: int) -> Ask:
    """The :class:`Ask` of a ``completions`` or ``prefill`` body; HttpError naming the bad field."""
    known = COMPLETION_FIELDS if kind == "completions" else PREFILL_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(f"unknown fields {unknown[:4]}; this endpoint takes {sorted(known)}", unknown[0])
    if "prompt" not in body:
        raise invalid("prompt is required: a string or a list of token ids", "prompt")
    model = body.get("model")
    if model is not None and model != model_id:
        raise invalid(
            f"model {str(model)[:80]!r} is not served here; use {model_id!r} (GET /v1/models)",
            "model",
            "model_not_found",
            404,
        )
    logprobs = None
    if kind == "completions":
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (
            max_tokens != 1 or not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
        ):
            raise invalid(
                f"max_tokens must be 1 (got {json.dumps(max_tokens)[:40]}): this endpoint prefills and answers the "
                "first token; decode further from POST /v1/prefill's KV cache (continue_greedy)",
                "max_tokens",
                "unsupported_value",
            )
        _flag(body, "n", 1, "one choice per request", integer=True)
        _flag(body, "stream", False, "answers are not streamed")
        _flag(body, "echo", False, "the prompt is not echoed")
        _flag(body, "temperature", 0, "the first token is the greedy one (temperature 0)")
        for key, neutral in NEUTRAL.items():
            value = body.get(key)
            if key == "seed":
                if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                    raise invalid(f"seed must be an integer (got {json.dumps(value)[:40]})", "seed")
            elif value not in (None, [], {}):  # the empty list of stop strings, no logit biases: the defaults too
                _flag(body, key, neutral, "this endpoint answers one greedy token, so only the default changes nothing")
        logprobs = body.get("logprobs")
        top = min(MAX_TOP_K, vocab)
        if logprobs is not None and (
            not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= top
        ):
            raise invalid(f"logprobs must be an integer 0-{top} (got {json.dumps(logprobs)[:40]})", "logprobs")
    kind_, frame, text = _prompt_frame(body["prompt"])
    header: dict[str, Any] = {"v": VERSION, "id": f"cmpl-{uuid.uuid4().hex[:24]}", "prompt": kind_}
    header.update({k: body[k] for k in ("priority", "deadline_ms", "top_k") if body.get(k) is not None})
    header["return_kv"] = kind == "prefill"
    try:
        request = decode_request([wire.encode_header(header), frame], max_prompt_tokens=max_prompt_tokens, vocab=vocab)
    except OverflowError:
        raise invalid("priority, deadline_ms and top_k must be numbers of ordinary size") from None
    except (BadRequest, ProtocolError) as exc:
        field = next((f for f in ("priority", "deadline_ms", "top_k") if f"'{f}'" in str(exc)), "prompt")
        raise invalid(str(exc), field) from None
    if logprobs is not None:
        request.top_k = vocab  # every logit: log-probabilities need the whole distribution's normaliser
    return Ask(request, text, logprobs)


def completion_body(ask: Ask, response: PrefillResponse, model_id: str, created: int) -> dict[str, Any]:
    """OpenAI's ``text_completion`` object for a served prefill (one choice: the greedy first token)."""
    assert response.first_token is not None
    text = token_text(response.first_token)
    logprobs = None
    if ask.logprobs is not None:
        logits = response.topk_logits  # every logit, highest first
        top = logits[0]
        normaliser = top + math.log(sum(math.exp(x - top) for x in logits))
        shown = response.topk_ids[: max(ask.logprobs, 1)]  # 0: the chosen token's alone, as OpenAI's API answers
        best = {token_text(t): x - normaliser for t, x in zip(shown, logits)}
        logprobs = {
            "tokens": [text],
            "token_logprobs": [top - normaliser],
            "top_logprobs": [best],
            "text_offset": [len(ask.prompt_text)],
        }
    return {
        "id": ask.request.id,
        "object": "text_completion",
        "created": created,
        "model": model_id,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": response.prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": response.prompt_tokens + 1,
        },
        "system_fingerprint": None if response.weights_step is None else f"geosched-step-{response.weights_step}",
        "geosched": {
            "first_token": response.first_token,
            "weights_step": response.weights_step,
            **response.timings,
            "chunks": int(response.timings.get("chunks", 0)),
        },
    }


def error_of(response: PrefillResponse) -> HttpError:
    """The HTTP error of a response that is not ``ok``: 429 rejected, 504 expired, 503 otherwise."""
    if response.status == "rejected":
        return HttpError(429, response.reason, "rate_limit_error", None, "rate_limit_exceeded")
    if response.status == "expired":
        return HttpError(504, response.reason, "timeout_error", "deadline_ms", "deadline_exceeded")
    return HttpError(503, response.reason or "prefill failed", "server_error", None, "unavailable")


def kv_safetensors(response: PrefillResponse) -> bytes:
    """A served prefill as safetensors: ``layers.<i>.k`` / ``layers.<i>.v`` (1, H, T, D) and the answer as metadata."""
    from safetensors.torch import save

    tensors = {}
    for i, (k, v) in enumerate(response.kv or []):
        tensors[f"layers.{i}.k"], tensors[f"layers.{i}.v"] = k.contiguous(), v.contiguous()
    metadata = {
        "format": KV_FORMAT,
        "id": str(response.id),
        "prompt_tokens": str(response.prompt_tokens),
        "first_token": str(response.first_token),
        "topk_ids": json.dumps(response.topk_ids),
        "topk_logits": json.dumps(response.topk_logits),
        "timings": json.dumps(response.timings),
    }
    if response.weights_step is not None:
        metadata["weights_step"] = str(response.weights_step)
    return bytes(save(tensors, metadata=metadata))


def response_from_safetensors(data: bytes) -> PrefillResponse:
    """The :class:`PrefillResponse` in a ``/v1/prefill`` answer (for ``continue_greedy``); ProtocolError if not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        size = int.from_bytes(data[:8], "little")
        if not 0 < size <= min(MAX_SAFETENSORS_HEADER, len(data) - 8):
            raise ValueError(f"header of {size} bytes")
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        if meta.get("format") != KV_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {KV_FORMAT!r}")
        ids, logits = top_k_lists(json.loads(meta["topk_ids"]), json.loads(meta["topk_logits"]))
        tensors = load(data)
        layers = len(tensors) // 2
        kv: KVCache = [(tensors[f"layers.{i}.k"], tensors[f"layers.{i}.v"]) for i in range(layers)]
        return PrefillResponse(
            meta["id"],
            "ok",
            prompt_tokens=int(meta["prompt_tokens"]),
            first_token=int(meta["first_token"]),
            topk_ids=ids,
            topk_logits=logits,
            kv=kv,
            timings=numbered_timings(json.loads(meta["timings"])),
            weights_step=int(meta["weights_step"]) if "weights_step" in meta else None,
        )
    except (SafetensorError, ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
        raise ProtocolError(f"not a prefill KV answer ({KV_FORMAT}): {printable(exc, 200)}") from None


__all__ = [
    "Ask",
    "HttpError",
    "completion_body",
    "error_of",
    "kv_safetensors",
    "load_json",
    "parse_request",
    "response_from_safetensors",
    "token_text",
]
