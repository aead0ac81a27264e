"""Multi-process test harness: a pool of N ranks that run test functions under a hard deadline.

Spawning N Python processes and importing torch costs seconds, so each world size gets one pool of worker
processes for the whole session; a test sends the name of a module-level function to every rank and waits
for all N results. A rank that raises, or a group that misses the deadline (a hang in a collective), fails
the test; unless every rank answered, the pool is killed and rebuilt for the next test, so CI never hangs.

Backend: gloo on CPU by default; ``MOE_CORE_TEST_BACKEND=nccl`` runs the same tests on NCCL with one CUDA
device per rank (world sizes above the GPU count are skipped).
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_core.parallel.launch import destroy_distributed

BACKEND = os.environ.get("MOE_CORE_TEST_BACKEND", "gloo")
DEFAULT_TIMEOUT_S = float(os.environ.get("MOE_CORE_TEST_TIMEOUT", "60"))
STARTUP_TIMEOUT_S = 120.0


class RankFailure(AssertionError):
    """A rank raised; the message holds every failing rank's traceback."""


class DeadlineExceeded(AssertionError):
    """The ranks did not all answer before the deadline (a hang): the pool was killed."""


def device() -> torch.device:
    """The device of this rank's tensors: its CUDA device under NCCL, else the CPU."""
    if BACKEND == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker(rank: int, world_size: int, init_file: str, tasks: mp.Queue, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        BACKEND, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=max(DEFAULT_TIMEOUT_S, 30)),
    )
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            results.put((rank, False, traceback.format_exc()))
    destroy_distributed()


class WorkerPool:
    """``world_size`` spawned ranks with an initialised default process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="moe_core_dist_")
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        ready = 0
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while ready < world_size:
            try:
                self._results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.close(kill=True)
                raise DeadlineExceeded(f"{world_size} ranks did not start within {STARTUP_TIMEOUT_S:.0f} s") from None
            ready += 1

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(**kwargs)`` on every rank; return the per-rank results, rank order.

        Raises ``RankFailure`` when a rank raised and ``DeadlineExceeded`` when not all ranks answered within
        ``timeout`` seconds; the pool is killed unless every rank answered (one may be stuck in a collective).
        """
        for q in self._tasks:
            q.put((fn.__module__, fn.__name__, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            # After a failure the others may be blocked in a collective: give them a short grace only.
            wait = deadline - time.monotonic() if not errors else min(2.0, deadline - time.monotonic())
            try:
                rank, ok, value = self._results.get(timeout=max(wait, 0.01))
            except queue.Empty:
                break
            (out if ok else errors)[rank] = value
        if errors or len(out) < self.world_size:
            if len(out) + len(errors) < self.world_size:
                self.close(kill=True)  # a rank may be stuck in a collective; answered ranks are back in the loop
            if errors:
                raise RankFailure("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
            missing = sorted(set(range(self.world_size)) - set(out))
            raise DeadlineExceeded(f"{fn.__name__}: ranks {missing} did not finish within {timeout:.0f} s (hang)")
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._dir.cleanup()


_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """The session's pool of ``world_size`` ranks (rebuilt after a failure); skips when NCCL lacks GPUs."""
    if BACKEND == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"NCCL world size {world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}")
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool


def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_distributed(world_size: int, fn: Callable[..., Any], timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any):
    """``get_pool(world_size).run(fn, timeout, **kwargs)``: the one call a test makes."""
    return get_pool(world_size).run(fn, timeout=timeout, **kwargs)
