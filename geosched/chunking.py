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
DEFAULT_MAX_CHUNK = 16 << 20
"""WanLinkConfig.max_chunk_bytes by default."""


def auto_chunk_bytes(total: int, streams: int, max_chunk: int = DEFAULT_MAX_CHUNK) -> int:
    """Chunk size for a message: about 16 chunks per stream, a power of two in [64 KiB, 4 MiB].

    Big tensors on few streams get big chunks (less per-chunk work: the loopback speed); many
    streams get smaller ones so the stripes stay balanced and the last stream does not lag.
    On one stream (links inside a DC) a message up to SINGLE_CHUNK_MAX goes as one chunk: there
    is nothing to stripe, and each chunk costs both ends a wake-up and an acknowledgement.
    """
    if streams <= 1 and total <= SINGLE_CHUNK_MAX:
        return min(max_chunk, 1 << max(AUTO_CHUNK_MIN_LOG2, (total - 1).bit_length()))
    target = max(1, total // (16 * max(1, streams)))
    return min(max_chunk, 1 << max(AUTO_CHUNK_MIN_LOG2, min(AUTO_CHUNK_MAX_LOG2, target.bit_length() - 1)))


def chunks_per_message(total: int, streams: int, chunk_bytes: int = 0) -> int:
    """Chunks a message of ``total`` bytes is sent in (``chunk_bytes`` 0: the automatic size)."""
    chunk = chunk_bytes or auto_chunk_bytes(total, streams)
    return max(1, -(-total // chunk))
