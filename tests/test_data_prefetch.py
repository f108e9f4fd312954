"""Prefetcher: batches in step order, producer errors re-raised, clean shutdown, exact resume."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from geosched.data import Prefetcher, TextDataset, default_corpus_paths
from geosched.errors import CheckpointError

REQUEST = dict(replica=1, dp_size=2, microbatch_size=2, num_microbatches=3)
DATASET = dict(seq_len=16, seed=4)  # the ``dataset`` fixture's cut of the corpus (tests/conftest.py)


@pytest.fixture(autouse=True)
def no_leftover_producers():
    """Fail a test that leaves a producer thread running."""
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("geosched-prefetch")]
    assert not left, f"producer threads left running: {left}"


def same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


@pytest.mark.parametrize("workers,depth", [(1, 2), (3, 4)])
def test_prefetched_batches_come_in_step_order_and_equal_direct_batches(dataset, workers, depth) -> None:
    with Prefetcher(dataset, **REQUEST, start_step=5, depth=depth, workers=workers) as feed:
        got = []
        for step, microbatches in feed:
            got.append(step)
            assert same(microbatches, dataset.batch(step, 1, 2, 2, 3))
            if len(got) == 7:
                break
        assert got == list(range(5, 12))
        assert same(feed.get(12), dataset.batch(12, 1, 2, 2, 3))
        assert same(feed.get(3), dataset.batch(3, 1, 2, 2, 3))  # seeking restarts the producers
        assert feed.state_dict()["next_step"] == 4


class CountingDataset(TextDataset):
    """A real TextDataset that counts the batches it was asked for."""

    made = 0

    def batch(self, *args, **kwargs):
        self.made += 1
        return super().batch(*args, **kwargs)


def test_producers_run_at_most_depth_steps_ahead() -> None:
    counting = CountingDataset(default_corpus_paths(), seq_len=16, seed=4)
    with Prefetcher(counting, **REQUEST, depth=2, workers=1) as feed:
        feed.get(0)
        # steps 1, 2 queued and step 3 made, waiting for room: 4 made, then the producer blocks
        deadline = time.monotonic() + 30
        while counting.made < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert counting.made == 4
        feed.get(1)
        assert same(feed.get(2), counting.batch(2, 1, 2, 2, 3))


def test_a_producer_error_is_re_raised_in_the_consumer(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_bytes(bytes(range(32, 127)) * 4)
    broken = TextDataset(str(tmp_path / "*.txt"), seq_len=64, seed=0)
    for i in range(3):
        (tmp_path / f"f{i}.txt").unlink()  # the producer's first read will fail
    feed = Prefetcher(broken, 0, 1, 4, 2)
    with pytest.raises(FileNotFoundError):
        feed.get()
    with pytest.raises(RuntimeError, match="closed"):
        feed.get()
    feed.close()  # idempotent


def test_close_joins_producers_blocked_on_a_full_queue(dataset) -> None:
    feed = Prefetcher(dataset, **REQUEST, depth=1, workers=2)
    threads = list(feed._threads)
    feed.get()
    feed.close()
    assert not any(t.is_alive() for t in threads)


def test_state_dict_resumes_exactly_and_refuses_another_corpus(dataset) -> None:
    with Prefetcher(dataset, **REQUEST) as feed:
        for _ in range(3):
            feed.get()
        state = feed.state_dict()
        expected = feed.get()
    with Prefetcher(dataset, **REQUEST) as resumed:
        resumed.load_state_dict(state)
        assert same(resumed.get(), expected)
        other = dict(state, corpus=dict(state["corpus"], seq_len=8))
        with pytest.raises(CheckpointError, match="same --data, seq_len and seed"):
            resumed.load_state_dict(other)
        with pytest.raises(CheckpointError, match="lacks next_step"):
            resumed.load_state_dict({})
