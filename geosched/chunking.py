"""How a message is cut into chunks on a link of k TCP streams: WanLink's policy, which the cost model prices.

Every chunk costs both ends a little CPU (a wake-up, a header, a checksum, an
acknowledgement), so the cost model counts chunks per message
(:func:`chunks_per_message`) with the same rule the link uses
(:func:`auto_chunk_bytes`). Torch-free, like the rest of the cost model.
"""

from __future__ import annotations

AUTO_CHUNK_MIN_LOG2, AUTO_CHUNK_MAX_LOG2 = 16, 22
"""Automatic chunks are powers of two in [64 KiB, 4 MiB]."""
SINGLE_CHUNK_MAX = 1 << 20
"""Largest message auto-chunking sends whole on a one-stream link."""
CHUNK_WIRE_BYTES = 224
"""What a chunk carries on the wire besides its payload: its header and ZeroMQ frames (about 150 bytes,
counted through the WAN emulator) and, on CURVE, each frame's nonce and MAC (about 70 more)."""
STRIPE_MIN = 2 << 10
"""Smallest stripe of a message too small for 64 KiB chunks on every stream of a multi-stream link."""
DEFAULT_MAX_CHUNK = 16 << 20
"""WanLinkConfig.max_chunk_bytes by default."""
MAX_STREAMS = 64
"""Most TCP streams a WanLink opens (its config's bound, and a cluster link's ``max_streams``)."""


def auto_chunk_bytes(total: int, streams: int, max_chunk: int = DEFAULT_MAX_CHUNK) -> int:
    """Chunk size for a message: about 16 chunks per stream, a power of two in [64 KiB, 4 MiB].

    Big tensors on few streams get big chunks (less per-chunk work: the loopback speed); many
    streams get smaller ones so the stripes stay balanced and the last stream does not lag.
    On one stream (links inside a DC) a message up to SINGLE_CHUNK_MAX goes as one chunk: there
    is nothing to stripe, and each chunk costs both ends a wake-up and an acknowledgement.
    A message smaller than a 64 KiB chunk per stream is cut into one stripe per stream (at least
    STRIPE_MIN): on a long link each TCP connection moves one window per round
    trip, so a message left on one stream would take ``streams`` times as long as the cost model
    prices it (:func:`geosched.netcost.wan_effective_bps`: every stream of the link).
    """
    if streams <= 1 and total <= SINGLE_CHUNK_MAX:
        return min(max_chunk, 1 << max(AUTO_CHUNK_MIN_LOG2, (total - 1).bit_length()))
    target = max(1, total // (16 * max(1, streams)))
    chunk = 1 << max(AUTO_CHUNK_MIN_LOG2, min(AUTO_CHUNK_MAX_LOG2, target.bit_length() - 1))
    stripe = -(-total // max(1, streams))
    if stripe < chunk:
        chunk = max(STRIPE_MIN, stripe)
    return min(max_chunk, chunk)


def wire_bytes(total: int, streams: int) -> int:
    """Bytes a message of ``total`` bytes puts on a link of ``streams`` streams: payload and every chunk's
    :data:`CHUNK_WIRE_BYTES`."""
    return total + chunks_per_message(total, streams) * CHUNK_WIRE_BYTES


def chunks_per_message(total: int, streams: int, chunk_bytes: int = 0) -> int:
    """Chunks a message of ``total`` bytes is sent in (``chunk_bytes`` 0: the automatic size)."""
    chunk = chunk_bytes or auto_chunk_bytes(total, streams)
    return max(1, -(-total // chunk))
