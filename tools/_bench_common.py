"""What the benchmark tools share: per-iteration timing (CUDA events, the wall clock on CPU), peak memory, the
profiler's kernel times by category, run metadata and the table's number formatting."""

from __future__ import annotations

import contextlib
import gc
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# Kernel categories, matched (case-insensitive) against a kernel's name without its template arguments and
# parameter list: prepare_groups<...cutlass::bfloat16_t...> is no GEMM. Nor is a grouped GEMM's setup kernel,
# named prepare... (torch._grouped_mm's prepare_grouped_gemm_data, moe_core's prepare_groups), whatever
# else its name says. The aten::... alternatives name the CPU ops that do a GEMM's work, for profiles on CPU.
GEMM = re.compile(r"^(?!.*prepare).*(cutlass|gemm|nvjet|xmma|wgmma|grouped_mm)|^aten::(mm|addmm|bmm|baddbmm)$",
                  re.IGNORECASE)
OPTIMIZER = re.compile(r"adam|multi_tensor|foreach", re.IGNORECASE)
ATTENTION = re.compile(r"flash|sdpa|fmha|attention", re.IGNORECASE)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(v: float | None, spec: str = "7.1f") -> str:
    return format(v, spec) if v is not None else "    n/a"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def iteration_ms(fn, iters: int, device: torch.device, inputs: list | tuple = ((),)) -> list[float]:
    """Per-iteration times in ms of ``fn(*inputs[i % len(inputs)])`` for ``i < iters``: CUDA events on a CUDA
    device (every pair recorded, one sync at the end), the wall clock around each synchronised call elsewhere."""
    if device.type != "cuda":
        times = []
        for i in range(iters):
            start = time.perf_counter()
            fn(*inputs[i % len(inputs)])
            times.append((time.perf_counter() - start) * 1e3)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        args = inputs[i % len(inputs)]
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def timed(fn, iters: int, warmup: int, device: torch.device) -> dict:
    """``fn()`` run ``warmup`` times, then timed ``iters`` times (``iteration_ms``), ``summarize``d."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    return summarize(iteration_ms(fn, iters, device))


def summarize(samples: list[float]) -> dict:
    """``median_ms``, ``min_ms``, ``max_ms``, ``spread`` (the 10th to 90th percentile range over the median; 0 for
    one sample) and ``iters`` of per-iteration times in ms."""
    median = statistics.median(samples)
    deciles = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else [median] * 9
    return dict(median_ms=median, min_ms=min(samples), max_ms=max(samples),
                spread=(deciles[8] - deciles[0]) / median if median else 0.0, iters=len(samples))


def peak_memory_gib(fn, device: torch.device) -> float | None:
    """GiB allocated at the peak of one ``fn()`` call above what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def kernel_times(fn, steps: int, device: torch.device) -> dict[str, float]:
    """``{name: ms per call}`` over ``steps`` calls of ``fn`` under torch.profiler: the GPU time of each CUDA
    kernel (and memcpy / memset) on a CUDA device, each op's self CPU time elsewhere."""
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        synchronize(device)
    totals: dict[str, float] = {}
    for event in prof.events():
        # A user annotation (``Optimizer.step#AdamW.step``) also has a CUDA-side range spanning its kernels.
        if on_cuda and (event.device_type != DeviceType.CUDA or event.is_user_annotation):
            continue
        us = event.time_range.elapsed_us() if on_cuda else event.self_cpu_time_total
        totals[event.name] = totals.get(event.name, 0.0) + us / 1e3 / steps
    return totals


def kernel_head(name: str) -> str:
    """A kernel's qualified name without ``void``, template arguments and parameters (what categories match)."""
    name = name.replace("(anonymous namespace)", "").removeprefix("void ")
    return re.split(r"[<(]", name, maxsplit=1)[0]


def breakdown(kernels: dict[str, float], categories: dict[str, re.Pattern]) -> dict:
    """Sum ``kernels`` (``{name: ms}``) by category, the first matching pattern in ``categories``' order, else
    ``rest``. Returns ``ms`` (``{category: ms}`` including ``rest``), ``total_ms``, and ``ranked``: every
    kernel as ``{name, ms, category}``, longest first."""
    ms = dict.fromkeys([*categories, "rest"], 0.0)
    ranked = []
    for name, t in kernels.items():
        head = kernel_head(name)
        category = next((c for c, pattern in categories.items() if pattern.search(head)), "rest")
        ms[category] += t
        ranked.append(dict(name=name, ms=t, category=category))
    ranked.sort(key=lambda k: -k["ms"])
    return dict(ms=ms, total_ms=sum(ms.values()), ranked=ranked)


def print_table(rows: list[dict], lead: list[tuple[str, int]], columns: list[tuple[str, int, object]]) -> None:
    """Print ``rows`` as a table: the ``lead`` keys left-aligned (``(key, width)``), then ``columns``
    (``(title, width, row -> text)``); a row with ``error`` shows the error instead of the columns."""
    header = " ".join(f"{k:{w}s}" for k, w in lead) + " " + " ".join(f"{t:>{w}s}" for t, w, _ in columns)
    print(header)
    print("-" * len(header))
    for r in rows:
        start = " ".join(f"{r[k]:{w}s}" for k, w in lead)
        if r.get("error"):
            print(f"{start} error: {r['error'][:80]}")
        else:
            print(start + " " + " ".join(f"{cell(r):>{w}s}" for _, w, cell in columns))


def error_message(err: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters): a failed provider's ``error``."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"


def free_memory() -> None:
    """Collect garbage and hand cached CUDA blocks back, so the next provider starts from what is live."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def single_thread(enabled: bool):
    """torch on one CPU thread inside when ``enabled``: smoke runs' tiny ops gain nothing from threads and lose
    much to a loaded machine's other processes."""
    threads = torch.get_num_threads()
    if enabled:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_metadata(device: torch.device) -> dict:
    """Device name, torch version and the repository's commit (None outside a git checkout)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(device=name, torch=torch.__version__, commit=commit)


__all__ = ["GEMM", "OPTIMIZER", "ATTENTION", "ratio", "fmt", "synchronize", "iteration_ms", "timed",
           "peak_memory_gib", "kernel_times", "kernel_head", "breakdown", "error_message", "free_memory",
           "single_thread", "run_metadata"]
