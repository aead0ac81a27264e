"""Prefetcher: batches in step order, made ahead in a thread, errors raised where the batch was due, the thread
stopped by close or by dropping the prefetcher."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from moe_core.training.batch import Batch
from moe_core.training.loader import Prefetcher


def _make(step: int) -> Batch:
    return Batch(torch.full((2, 4), step), torch.full((2, 4), -step))


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "moe_core-prefetch"]


def test_batches_come_in_step_order_and_ahead_of_time():
    made = []

    def make(step):
        made.append(step)
        return _make(step)

    batches = Prefetcher(make, range(3, 9), torch.device("cpu"), depth=2)
    time.sleep(0.2)
    assert made == [3, 4, 5]  # two queued, one made and waiting for room
    for step in range(3, 9):
        batch, waited = batches.next()
        assert batch.input_ids[0, 0].item() == step and batch.position_ids is None and waited >= 0
    batches.close()
    assert not _prefetch_threads()


def test_an_error_is_raised_by_the_next_that_was_due():
    def make(step):
        if step == 2:
            raise ValueError("data_path: broken at step 2")
        return _make(step)

    batches = Prefetcher(make, range(5), torch.device("cpu"))
    assert [batches.next()[0].input_ids[0, 0].item() for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="broken at step 2"):
        batches.next()
    batches.close()


def test_the_thread_stops_when_the_prefetcher_is_dropped():
    batches = Prefetcher(_make, range(1000), torch.device("cpu"), depth=1)
    batches.next()
    del batches
    gc.collect()
    deadline = time.monotonic() + 5
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _prefetch_threads()


def test_waiting_is_timed():
    batches = Prefetcher(lambda step: (time.sleep(0.3), _make(step))[1], range(1), torch.device("cpu"))
    _, waited = batches.next()
    batches.close()
    assert 0.2 < waited < 5
