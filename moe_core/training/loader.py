"""Batches made ahead of the training step in a background thread, so reading data never stalls the device.

The thread calls ``make(step)`` for each step in turn, at most ``depth`` steps ahead, and on CUDA pins each batch
so that ``next`` copies it to the device without blocking the host (the copy is ordered before the step's kernels
on the current stream). The time ``next`` waits for the thread is the run's data stall (the trainer's
``data_wait_ms``).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch

from moe_core.training.batch import Batch


class Prefetcher:
    """``make(step)`` for each of ``steps``, made in a background thread (module docstring).

    Args:
        make: step -> this rank's ``Batch`` of it (CPU tensors).
        steps: the steps, in the order ``next`` returns them.
        device: where ``next`` puts each batch.
        depth: batches made ahead at most.
    An error in ``make`` is raised by the ``next`` that would have returned its batch. ``close`` stops the
    thread; so does dropping the last reference to the prefetcher (a loop left by an exception): the thread holds
    only a weak one.
    """

    def __init__(self, make: Callable[[int], Batch], steps: Iterable[int], device: torch.device, depth: int = 2):
        self._device = device
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, name="moe_core-prefetch", daemon=True,
                                        args=(make, steps, device.type == "cuda", self._queue, self._stop,
                                              weakref.ref(self)))
        self._thread.start()

    def next(self) -> tuple[Batch, float]:
        """The next step's batch on the device, and the seconds spent waiting for it."""
        start = time.perf_counter()
        batch, error = self._queue.get()
        waited = time.perf_counter() - start
        if error is not None:
            raise error
        return batch.to(self._device, non_blocking=True), waited

    def close(self) -> None:
        """Stop the thread (batches made ahead are dropped)."""
        self._stop.set()
        self._thread.join()


def _produce(make: Callable[[int], Batch], steps: Iterable[int], pin: bool, out: queue.Queue,
             stop: threading.Event, owner: weakref.ref) -> None:
    """The thread: each step's batch (or the error making it) into ``out`` until ``stop`` or the owner is gone."""
    def put(item) -> bool:
        while not stop.is_set() and owner() is not None:
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for step in steps:
            batch = make(step)
            if not put((batch.pin_memory() if pin else batch, None)):
                return
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
        put((None, e))


__all__ = ["Prefetcher"]
