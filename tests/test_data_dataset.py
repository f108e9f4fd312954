"""TextDataset: the joined byte stream, per-step determinism, replicas vs the global batch."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from geosched.data import SEPARATOR, TextDataset, default_corpus_paths, resolve_paths
from geosched.errors import InputError


@pytest.fixture()
def corpus(tmp_path: Path) -> tuple[list[Path], bytes]:
    """Three small files (one empty) and the stream they should join into."""
    texts = [b"hello world, this is file one.\n", b"", b"second file\nwith two lines\n", b"third" * 7]
    paths = []
    for i, text in enumerate(texts):
        path = tmp_path / f"doc{i}.txt"
        path.write_bytes(text)
        paths.append(path)
    stream = b"".join(t + bytes([SEPARATOR]) for t in texts if t)
    return paths, stream


def digest(microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """A hash of every input and target tensor, in order."""
    h = hashlib.sha256()
    for inputs, targets in microbatches:
        h.update(inputs.numpy().tobytes())
        h.update(targets.numpy().tobytes())
    return h.hexdigest()


def test_stream_joins_files_with_a_separator_and_reads_across_boundaries(corpus) -> None:
    paths, stream = corpus
    ds = TextDataset([str(p) for p in paths], seq_len=8)
    assert len(ds) == len(stream)
    assert ds.read(0, len(stream)).tobytes() == stream
    for start in range(0, len(stream) - 9):
        assert ds.read(start, 9).tobytes() == stream[start : start + 9]


def test_samples_are_windows_of_the_stream_with_shifted_targets(corpus) -> None:
    paths, stream = corpus
    ds = TextDataset(str(paths[0].parent / "*.txt"), seq_len=8, seed=1)
    inputs, targets = ds.global_batch(step=3, global_batch_size=5)
    assert inputs.shape == targets.shape == (5, 8) and inputs.dtype == torch.int64
    for pos, row_in, row_t in zip(ds.sample_positions(3, 5), inputs, targets):
        window = stream[int(pos) : int(pos) + 9]
        assert bytes(row_in.tolist()) == window[:-1] and bytes(row_t.tolist()) == window[1:]


def test_batches_are_a_pure_function_of_seed_and_step() -> None:
    ds = TextDataset(default_corpus_paths(), seq_len=32, seed=0)
    again = TextDataset(default_corpus_paths(), seq_len=32, seed=0)
    assert digest(ds.batch(5, 1, 2, 2, 3)) == digest(again.batch(5, 1, 2, 2, 3))
    assert digest(ds.batch(5, 1, 2, 2, 3)) != digest(ds.batch(6, 1, 2, 2, 3))
    other_seed = TextDataset(default_corpus_paths(), seq_len=32, seed=1)
    assert digest(ds.batch(5, 1, 2, 2, 3)) != digest(other_seed.batch(5, 1, 2, 2, 3))


def test_union_of_replicas_is_the_global_batch_in_replica_order() -> None:
    ds = TextDataset(default_corpus_paths(), seq_len=16, seed=2)
    dp, b, m = 3, 2, 4
    parts = [mb for r in range(dp) for mb in ds.batch(7, r, dp, b, m)]
    assert len(parts) == dp * m and all(x.shape == (b, 16) for x, _ in parts)
    inputs, targets = ds.global_batch(7, dp * m * b)
    assert torch.equal(torch.cat([x for x, _ in parts]), inputs)
    assert torch.equal(torch.cat([y for _, y in parts]), targets)
    # the same global batch cut differently (dp 1 x 6 microbatches of 4) holds the same samples
    regrouped = ds.batch(7, 0, 1, 4, 6)
    assert torch.equal(torch.cat([x for x, _ in regrouped]), inputs)


@pytest.mark.slow
def test_another_process_gets_the_same_batches() -> None:
    code = (
        "import hashlib, sys\n"
        "from geosched.data import TextDataset, default_corpus_paths\n"
        "ds = TextDataset(default_corpus_paths(), seq_len=32, seed=0)\n"
        "h = hashlib.sha256()\n"
        "for x, y in ds.batch(5, 1, 2, 2, 3):\n"
        "    h.update(x.numpy().tobytes()); h.update(y.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    ds = TextDataset(default_corpus_paths(), seq_len=32, seed=0)
    assert out.stdout.strip() == digest(ds.batch(5, 1, 2, 2, 3))


def test_default_corpus_is_the_sorted_stdlib() -> None:
    paths = default_corpus_paths()
    assert paths == sorted(paths) and len(paths) > 50
    assert any(p.endswith(os.sep + "os.py") for p in paths)


def test_bad_data_paths_name_the_pattern_and_the_remedy(tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing-*.txt")
    with pytest.raises(InputError, match=r"matches no files; pass --data") as err:
        resolve_paths([missing])
    assert missing in str(err.value)
    with pytest.raises(InputError, match="is a directory"):
        resolve_paths(str(tmp_path))
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"abc")
    with pytest.raises(InputError, match="fewer than one sample"):
        TextDataset(str(tiny), seq_len=8)
    ds = TextDataset(str(tiny), seq_len=2)
    with pytest.raises(InputError, match="replica 2 of dp 2"):
        ds.batch(0, 2, 2, 1, 1)


def test_windows_inside_documents_and_across_separators_are_the_stream_s_bytes(corpus) -> None:
    """Gathered per document where a window fits in one, read byte by byte where it crosses a separator."""
    paths, stream = corpus
    ds = TextDataset([str(p) for p in paths], seq_len=8)
    positions = np.arange(len(stream) - 9, dtype=np.int64)[::-1].copy()  # every start, in no sorted order
    windows = ds.windows(positions)
    assert windows.shape == (len(positions), 9)
    assert [row.tobytes() for row in windows] == [stream[p : p + 9] for p in positions]
