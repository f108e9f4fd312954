"""Byte-level training data: a deterministic sampler over text files and background producers.

:class:`TextDataset` joins the bytes of the given files into one long stream
(each file followed by a separator byte; files are memory-mapped, so a corpus
larger than memory works) and samples windows of ``seq_len + 1`` bytes at
positions drawn from a generator seeded by ``(seed, step)`` only. A batch is a
pure function of the step:

- ``global_batch(step, G)`` is what a one-process run trains on at ``step``;
- ``batch(step, replica, dp, b, m)`` is replica ``replica``'s ``m`` microbatches
  of ``b`` samples, the slice ``[replica*m*b, (replica+1)*m*b)`` of the global
  batch of size ``G = dp*m*b``, cut into microbatches in order.

So every replica, stage and process agrees without talking, pipelined + DP
losses compare with a one-process run, and resuming from a step is exact.
:class:`Prefetcher` prepares the next steps' batches in background threads
(bounded FIFO, producer/consumer) while the stage computes.

Example::

    ds = TextDataset(default_corpus_paths(), seq_len=64, seed=0)
    with Prefetcher(ds, replica=0, dp_size=2, microbatch_size=4, num_microbatches=8) as feed:
        for step, microbatches in feed:        # [(inputs (4, 64), targets (4, 64)) x 8]
            ...
"""

from __future__ import annotations

import glob
import logging
import os
import queue
import sysconfig
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from geosched.errors import CheckpointError, InputError

log = logging.getLogger(__name__)

SEPARATOR = 0x00
"""Byte placed after every document in the joined stream."""
MAX_OPEN_FILES = 64
"""Memory maps kept open at once (least recently used are closed)."""

Microbatch = tuple[Tensor, Tensor]
"""(inputs (b, T) int64, targets (b, T) int64); targets are inputs shifted by one byte."""


def default_corpus_paths() -> list[str]:
    """The demo corpus, present on every machine: the Python standard library's ``*.py`` files, sorted."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def resolve_paths(paths_or_globs: str | Sequence[str]) -> list[str]:
    """Expand files and globs (``**`` allowed) into a sorted, de-duplicated list of files."""
    patterns = [paths_or_globs] if isinstance(paths_or_globs, (str, os.PathLike)) else list(paths_or_globs)
    if not patterns:
        raise InputError("no data files given; pass --data with a file or glob such as 'corpus/*.txt'")
    found: set[str] = set()
    for pattern in patterns:
        pattern = os.fspath(pattern)
        if os.path.isdir(pattern):
            raise InputError(
                f"data path {pattern!r} is a directory; pass a glob such as '{pattern}/**/*.txt' to --data"
            )
        matches = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matches:
            raise InputError(f"data pattern {pattern!r} matches no files; pass --data with existing files or a glob")
        found.update(matches)
    return sorted(found)


class TextDataset:
    """One byte stream over text files, sampled deterministically per (seed, step)."""

    def __init__(
        self,
        paths_or_globs: str | Sequence[str],
        seq_len: int,
        *,
        seed: int = 0,
        separator: int = SEPARATOR,
    ) -> None:
        if seq_len < 1:
            raise InputError(f"seq_len must be >= 1 (got {seq_len})")
        if not 0 <= separator <= 255:
            raise InputError(f"separator must be a byte value 0..255 (got {separator})")
        paths = resolve_paths(paths_or_globs)
        sizes = [os.path.getsize(p) for p in paths]
        kept = [(p, s) for p, s in zip(paths, sizes) if s > 0]  # an empty file cannot be mapped and adds nothing
        self.paths = [p for p, _ in kept]
        self.sizes = np.array([s for _, s in kept], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes + 1)[:-1]]).astype(np.int64)  # doc i's offset
        self.total_bytes = int((self.sizes + 1).sum())  # every doc + its separator
        self.seq_len = seq_len
        self.seed = seed
        self.separator = separator
        if self.total_bytes < seq_len + 1:
            raise InputError(
                f"data has {self.total_bytes} bytes in {len(self.paths)} non-empty files, fewer than one "
                f"sample of seq_len+1 = {seq_len + 1}; pass more data with --data or lower seq_len"
            )
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()  # plain views of the maps: slicing a memmap costs more
        self._lock = threading.Lock()  # producers share the map cache
        log.info("data: %d files, %d bytes, seq_len %d", len(self.paths), self.total_bytes, seq_len)

    def __len__(self) -> int:
        """Bytes in the joined stream."""
        return self.total_bytes

    def _file(self, index: int) -> np.ndarray:
        with self._lock:
            mapped = self._maps.pop(index, None)
            if mapped is None:
                mapped = np.asarray(np.memmap(self.paths[index], dtype=np.uint8, mode="r"))  # keeps the map open
                while len(self._maps) >= MAX_OPEN_FILES:
                    self._maps.popitem(last=False)
            self._maps[index] = mapped  # most recently used last
            return mapped

    def read(self, start: int, length: int) -> np.ndarray:
        """Bytes ``[start, start+length)`` of the joined stream as uint8 (length,)."""
        assert 0 <= start and start + length <= self.total_bytes, "read past the end of the stream"
        out = np.empty(length, dtype=np.uint8)
        doc = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self.starts[doc])  # within doc + separator
            size = int(self.sizes[doc])
            if offset < size:
                take = min(size - offset, length - filled)
                out[filled : filled + take] = self._file(doc)[offset : offset + take]
            else:
                take = 1
                out[filled] = self.separator
            filled += take
            if offset + take > size:  # consumed this doc's separator
                doc += 1
        return out

    def sample_positions(self, step: int, global_batch_size: int) -> np.ndarray:
        """Start offsets (G,) of the global batch of ``step``, from a generator seeded by (seed, step)."""
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        return rng.integers(0, self.total_bytes - self.seq_len, size=global_batch_size, dtype=np.int64)

    def windows(self, positions: np.ndarray) -> np.ndarray:
        """The ``seq_len + 1`` bytes at each of ``positions`` (n,): (n, T+1) uint8, as :meth:`read` gives them.

        A window inside one document (nearly all, for documents longer than a window) is one slice of its
        file's map; the rest, which cross a separator, go through :meth:`read`. :meth:`read` per window cost a
        prefetch thread 0.44 ms a step of the benchmark's 32 samples, on the core the stage computes on.
        """
        length = self.seq_len + 1
        out = np.empty((len(positions), length), dtype=np.uint8)
        docs = np.searchsorted(self.starts, positions, side="right") - 1  # (n,)
        offsets = positions - self.starts[docs]  # (n,) within the document
        inside = (offsets + length <= self.sizes[docs]).tolist()  # the window ends before the separator
        files: dict[int, np.ndarray] = {}
        for row, (doc, offset, fits) in enumerate(zip(docs.tolist(), offsets.tolist(), inside, strict=True)):
            if not fits:
                out[row] = self.read(int(positions[row]), length)
                continue
            data = files.get(doc)
            if data is None:
                data = files[doc] = self._file(doc)
            out[row] = data[offset : offset + length]
        return out

    def _samples(self, positions: np.ndarray) -> Microbatch:
        tokens = torch.from_numpy(self.windows(positions).astype(np.int64))  # (n, T+1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (n, T), (n, T)

    def global_batch(self, step: int, global_batch_size: int) -> Microbatch:
        """The one-process batch of ``step``: inputs, targets (G, T); replicas' microbatches concatenated in order."""
        if step < 0 or global_batch_size < 1:
            raise InputError(f"need step >= 0 and global batch >= 1 (got step {step}, batch {global_batch_size})")
        return self._samples(self.sample_positions(step, global_batch_size))

    def batch(
        self, step: int, replica: int, dp_size: int, microbatch_size: int, num_microbatches: int
    ) -> list[Microbatch]:
        """Replica ``replica``'s microbatches of ``step``: its slice of ``global_batch(step, dp*m*b)``."""
        if min(dp_size, microbatch_size, num_microbatches) < 1 or not 0 <= replica < dp_size or step < 0:
            raise InputError(
                f"bad batch request: step {step}, replica {replica} of dp {dp_size}, "
                f"{num_microbatches} microbatches of {microbatch_size}; need 0 <= replica < dp and sizes >= 1"
            )
        per_replica = num_microbatches * microbatch_size
        everyone = self.sample_positions(step, dp_size * per_replica)  # (G,)
        positions = everyone[replica * per_replica : (replica + 1) * per_replica]  # (m*b,)
        inputs, targets = self._samples(positions)  # (m*b, T) each
        return list(zip(torch.split(inputs, microbatch_size), torch.split(targets, microbatch_size)))

    def fingerprint(self) -> dict[str, int]:
        """What must match for a saved data position to mean the same batches (machine-independent)."""
        return _fingerprint(self.sizes, self.seq_len, self.seed)


def corpus_fingerprint(paths_or_globs: str | Sequence[str], seq_len: int, seed: int) -> dict[str, int]:
    """:meth:`TextDataset.fingerprint` of these files without opening them (their sizes only): what every rank
    that reads the data must agree on, since stage 0 takes the inputs and the last stage the targets of the same
    samples (InputError for paths that match nothing)."""
    sizes = [s for s in (os.path.getsize(p) for p in resolve_paths(paths_or_globs)) if s > 0]
    return _fingerprint(np.array(sizes, dtype=np.int64), seq_len, seed)


def _fingerprint(sizes: np.ndarray, seq_len: int, seed: int) -> dict[str, int]:
    """Files, bytes (each with its separator), a CRC32 of the files' sizes in order, seq_len and seed."""
    return {
        "files": len(sizes),
        "bytes": int((sizes + 1).sum()),
        "sizes_crc32": zlib.crc32(sizes.astype("<i8").tobytes()),
        "seq_len": seq_len,
        "seed": seed,
    }


class _Failure:
    """A producer's exception, carried through the queue to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_Produced = tuple[int, list[Microbatch]] | _Failure  # what a producer queues: (step, its microbatches) or its error


class Prefetcher:
    """Background producers that keep the next steps' microbatches ready in bounded FIFO queues.

    Worker ``w`` of ``W`` prepares steps ``start + w, start + w + W, ...`` into
    its own queue of ``ceil(depth / W)`` entries; :meth:`get` takes them back
    in step order. A producer's exception is re-raised by :meth:`get`.
    """

    def __init__(
        self,
        dataset: TextDataset,
        replica: int,
        dp_size: int,
        microbatch_size: int,
        num_microbatches: int,
        start_step: int = 0,
        *,
        depth: int = 2,
        workers: int = 1,
    ) -> None:
        if depth < 1 or workers < 1:
            raise InputError(f"prefetch depth and workers must be >= 1 (got depth {depth}, workers {workers})")
        self.dataset = dataset
        self.request = (replica, dp_size, microbatch_size, num_microbatches)
        self.depth = depth
        self.workers = workers
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._start(start_step)

    def _start(self, step: int) -> None:
        self._base = self._next = step
        self._stop = threading.Event()
        per_queue = -(-self.depth // self.workers)
        self._queues: list[queue.Queue[_Produced]] = [queue.Queue(maxsize=per_queue) for _ in range(self.workers)]
        self._threads = [
            threading.Thread(
                target=self._produce,
                args=(step + w, self._queues[w], self._stop),
                name=f"geosched-prefetch-r{self.request[0]}-{w}",
                daemon=True,
            )
            for w in range(self.workers)
        ]
        for thread in self._threads:
            thread.start()

    def _produce(self, step: int, out: queue.Queue[_Produced], stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                item = (step, self.dataset.batch(step, *self.request))
                if not self._put(out, item, stop):
                    return
                step += self.workers
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(out, _Failure(exc), stop)

    @staticmethod
    def _put(out: queue.Queue[_Produced], item: _Produced, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def get(self, step: int | None = None) -> list[Microbatch]:
        """The microbatches of ``step`` (default: the next one); another step restarts the producers there."""
        if self._closed:
            raise RuntimeError("Prefetcher is closed")
        if step is None:
            step = self._next
        if step != self._next:
            log.info("prefetch: seeking from step %d to %d", self._next, step)
            self._halt()
            self._start(step)
        worker = (step - self._base) % self.workers
        while True:
            try:
                item = self._queues[worker].get(timeout=0.1)
                break
            except queue.Empty:
                if not self._threads[worker].is_alive() and self._queues[worker].empty():
                    raise RuntimeError(f"prefetch producer {worker} exited without a batch for step {step}") from None
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        got_step, microbatches = item
        assert got_step == step, f"prefetch order broken: wanted step {step}, got {got_step}"
        self._next = step + 1
        return microbatches

    def __iter__(self) -> Iterator[tuple[int, list[Microbatch]]]:
        """Endless (step, microbatches) from the next step on."""
        while True:
            step = self._next
            yield step, self.get(step)

    def state_dict(self) -> dict[str, Any]:
        """The data position for a checkpoint: the next step to train, and the corpus it refers to."""
        return {"next_step": self._next, "corpus": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position (exact: batches are a pure function of the step)."""
        try:
            step, corpus = int(state["next_step"]), dict(state["corpus"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"data state {state!r} lacks next_step/corpus ({exc}); save it with Prefetcher.state_dict()"
            ) from None
        if corpus != self.dataset.fingerprint():
            raise CheckpointError(
                f"checkpoint data position refers to corpus {corpus}, but this run has "
                f"{self.dataset.fingerprint()}; resume with the same --data, seq_len and seed"
            )
        if step != self._next:
            self._halt()
            self._start(step)

    def _halt(self) -> None:
        self._stop.set()
        for q in self._queues:  # unblock producers waiting on a full queue
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for thread in self._threads:
            thread.join(timeout=10.0)
            if thread.is_alive():
                log.warning("prefetch producer %s did not stop within 10 s", thread.name)
        self._threads = []

    def close(self) -> None:
        """Stop and join the producers; idempotent."""
        if not self._closed:
            self._closed = True
            self._halt()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
