"""What the distributed benchmark tools share: this rank's device, timing of lockstep iterations, the slowest rank's
figure, and the NCCL floor of a step's collectives (the same calls, recorded once, replayed alone).

Run under torchrun (NCCL on GPUs, gloo on CPU); every function here is collective over the default group unless it
says otherwise, so every rank must call it in the same order.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor")


def rank_device() -> torch.device:
    """This rank's CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lockstep_ms(phases, iters: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Per-iteration times in ms of each phase of ``phases()``, a generator yielding a phase name after finishing it.

    Every iteration starts after a barrier, so ranks enter together. CUDA events around each phase on a CUDA
    device (one sync per iteration, outside the timed span), the wall clock elsewhere. Returns
    ``{phase: [ms per timed iteration]}``.
    """
    times: dict[str, list[float]] = {}
    for i in range(warmup + iters):
        dist.barrier()
        marks = [_mark(device)]
        names = []
        for name in phases():
            marks.append(_mark(device))
            names.append(name)
        if device.type == "cuda":
            marks[-1].synchronize()
        if i >= warmup:
            for name, start, stop in zip(names, marks[:-1], marks[1:], strict=True):
                times.setdefault(name, []).append(_elapsed_ms(start, stop))
    return times


def _mark(device: torch.device):
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(start, stop) -> float:
    if isinstance(start, float):
        return (stop - start) * 1e3
    return start.elapsed_time(stop)


def slowest_rank(values: list[float], device: torch.device) -> list[float]:
    """The maximum over ranks of each value (a step is as slow as its slowest rank)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@dataclass(frozen=True)
class Collective:
    """One recorded call of a ``torch.distributed`` collective: its name, tensors' shapes and dtype, other arguments."""

    name: str
    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @property
    def bytes_in(self) -> int:
        """Bytes this rank hands to the collective."""
        return math.prod(self.in_shape) * self.dtype.itemsize


@contextlib.contextmanager
def recording(calls: list[Collective]):
    """Append to ``calls`` every collective of ``COLLECTIVES`` issued inside (they still run)."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def recorder(name):
        def call(out, inp, *args, **kwargs):
            calls.append(Collective(name, tuple(out.shape), tuple(inp.shape), inp.dtype, args, dict(kwargs)))
            return originals[name](out, inp, *args, **kwargs)
        return call

    try:
        for name in COLLECTIVES:
            setattr(dist, name, recorder(name))
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def replay(calls: list[Collective], device: torch.device):
    """A function that issues ``calls`` again, in order, on buffers of the same shapes (allocated once): the time of
    the data movement alone, the NCCL floor of the step that issued them."""
    buffers = [(torch.empty(c.out_shape, dtype=c.dtype, device=device), torch.zeros(c.in_shape, dtype=c.dtype,
                                                                                     device=device)) for c in calls]

    def run():
        for c, (out, inp) in zip(calls, buffers, strict=True):
            getattr(dist, c.name)(out, inp, *c.args, **c.kwargs)

    return run


def all_to_all_sweep(mib_per_rank: list[int], iters: int, warmup: int, group_size: int,
                     device: torch.device) -> list[dict]:
    """``all_to_all_single`` of equal splits, ``mib`` MiB out per rank (bf16): median ms and bus bandwidth
    (bytes sent to other ranks per second, nccl-tests' busbw: ``bytes * (n - 1) / n / time``)."""
    rows = []
    for mib in mib_per_rank:
        elements = mib * 2**20 // 2 // group_size * group_size
        run = replay([Collective("all_to_all_single", (elements,), (elements,), torch.bfloat16)], device)
        med = slowest_rank([statistics.median(lockstep_ms(_phase(run, "a2a"), iters, warmup, device)["a2a"])],
                           device)[0]
        sent = elements * 2 * (group_size - 1) / group_size
        rows.append(dict(mib_out_per_rank=mib, median_ms=med, busbw_gbs=sent / med / 1e6))
    return rows


def _phase(fn, name: str):
    """``phases`` for ``lockstep_ms`` of one phase: ``fn()``."""
    def phases():
        fn()
        yield name
    return phases


__all__ = ["COLLECTIVES", "rank_device", "lockstep_ms", "slowest_rank", "Collective", "recording",
           "replay", "all_to_all_sweep"]
