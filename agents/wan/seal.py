"""AES-256-GCM on every frame of an encrypted WanLink session (keys from :mod:`agents.wan.handshake`).

A sealed message is one or two frames: ``b"S"``, the 8-byte little-endian
counter ``n`` and the encrypted header; then, for ``data`` and ``resp``, the
encrypted payload. Each direction and stream counts its own messages from 1;
the nonce is ``(direction, part, stream, n)``, so no key ever sees a nonce
twice. The receiver opens a header only if its ``n`` is above the last it
opened on that stream (a replayed or reordered frame is dropped and the
sender's resend carries a new ``n``), and opens it before anything is
allocated for it; a data payload is decrypted straight into its slice of the
destination tensor, one pass per byte (a payload that fails its tag leaves
its chunk unreceived, to be resent).

Keys change every ``2**EPOCH_BITS`` messages of a stream (HKDF-Expand of the
session secret), so one key seals at most 2**16 chunks (at most 1 TiB at the
largest chunk size, 64 GiB at the usual 1 MiB), well within AES-GCM's limits.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from agents.wan.metrics import Dropped

Bytes = bytes | bytearray | memoryview
MARK = b"S"
TAG_BYTES = 16
HEAD_BYTES = len(MARK) + 8  # mark + counter, before the sealed header
EPOCH_BITS = 16
TO_SERVER, TO_CLIENT = 0, 1
HEADER, PAYLOAD = 0, 1
_INFO = b"geosched-wan-1 frames"


class SealError(Dropped):
    """A sealed frame that must be dropped: ``reason`` is its metrics label."""


def is_sealed(frame: Bytes) -> bool:
    """Whether a header frame is sealed (a clear handshake header is a msgpack map, never ``S``)."""
    return memoryview(frame)[:1] == MARK


class FrameSeal:
    """Seal and open one session's frames (one object per session and side; used by the link's I/O thread)."""

    def __init__(self, secret: bytes, *, listening: bool) -> None:
        self._secret = secret
        self._out_dir, self._in_dir = (TO_CLIENT, TO_SERVER) if listening else (TO_SERVER, TO_CLIENT)
        self._sent: dict[int, int] = {}  # stream -> last counter sealed
        self._opened: dict[int, int] = {}  # stream -> last counter opened
        self._keys: dict[tuple[int, int], tuple[int, AESGCM]] = {}  # (direction, stream) -> (epoch, cipher)

    def _cipher(self, direction: int, stream: int, n: int) -> AESGCM:
        epoch = n >> EPOCH_BITS
        cached = self._keys.get((direction, stream))
        if cached is not None and cached[0] == epoch:
            return cached[1]
        info = _INFO + bytes([direction]) + stream.to_bytes(2, "little") + epoch.to_bytes(6, "little")
        cipher = AESGCM(HKDFExpand(algorithm=hashes.SHA256(), length=32, info=info).derive(self._secret))
        self._keys[(direction, stream)] = (epoch, cipher)
        return cipher

    @staticmethod
    def _nonce(direction: int, part: int, stream: int, n: int) -> bytes:
        return bytes([direction, part]) + stream.to_bytes(2, "little") + n.to_bytes(8, "little")

    def seal(self, stream: int, header: bytes, payload: Bytes | None = None) -> list[bytes]:
        """The frames of one message: the sealed header, and the sealed payload if there is one."""
        n = self._sent.get(stream, 0) + 1
        self._sent[stream] = n
        cipher = self._cipher(self._out_dir, stream, n)
        frames = [
            MARK + n.to_bytes(8, "little") + cipher.encrypt(self._nonce(self._out_dir, HEADER, stream, n), header, None)
        ]
        if payload is not None:
            frames.append(cipher.encrypt(self._nonce(self._out_dir, PAYLOAD, stream, n), payload, None))
        return frames

    def open_header(self, stream: int, frame: Bytes) -> tuple[int, bytes]:
        """``(n, header)`` of a sealed header frame that arrived on ``stream``; SealError if it does not open."""
        view = memoryview(frame)
        if len(view) < HEAD_BYTES + TAG_BYTES or view[:1] != MARK:
            raise SealError("auth_failed", f"sealed header of {len(view)} bytes is malformed")
        n = int.from_bytes(view[1:HEAD_BYTES], "little")
        if n <= self._opened.get(stream, 0):
            raise SealError("replayed_frame", f"frame counter {n} not above the last one opened on stream {stream}")
        try:
            header = self._cipher(self._in_dir, stream, n).decrypt(
                self._nonce(self._in_dir, HEADER, stream, n), view[HEAD_BYTES:], None
            )
        except InvalidTag:
            raise SealError("auth_failed", "sealed header does not verify (wrong key, or altered)") from None
        self._opened[stream] = n
        return n, header

    def open_payload(self, stream: int, n: int, frame: Bytes) -> bytes:
        """The payload of the message whose header opened as ``n``; SealError if it does not verify."""
        try:
            return self._cipher(self._in_dir, stream, n).decrypt(
                self._nonce(self._in_dir, PAYLOAD, stream, n), frame, None
            )
        except InvalidTag:
            raise SealError("auth_failed", "sealed payload does not verify (altered in transit)") from None

    def open_payload_into(self, stream: int, n: int, frame: Bytes, out: Bytes) -> None:
        """Decrypt a payload straight into ``out`` (its exact size); SealError if it does not verify."""
        try:
            self._cipher(self._in_dir, stream, n).decrypt_into(
                self._nonce(self._in_dir, PAYLOAD, stream, n), frame, None, out
            )
        except InvalidTag:
            raise SealError("auth_failed", "sealed payload does not verify (altered in transit)") from None
