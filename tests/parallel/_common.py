"""Helpers that run inside the ranks: cached process groups, comparisons that report their error."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from moe_core.parallel.process_groups import build_process_groups
from tests.parallel._launch import device


@functools.cache
def groups(ep: int, num_experts: int = 8, tp: int = 1, etp: int = 1):
    """One ProcessGroupCollection per (EP, experts, TP, ETP) for the life of the worker pool."""
    return build_process_groups(ep, tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
                                num_moe_experts=num_experts, device_type=device().type)


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, stats: dict, rtol=1e-5, atol=1e-6) -> None:
    """assert_close with explicit fp32 tolerances; record (max abs, max rel) error under ``name``."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    err = (actual - expected).abs()
    rel = err / expected.abs().clamp_min(1e-12)
    prev = stats.get("max_abs", 0.0), stats.get("max_rel", 0.0)
    stats["max_abs"] = max(prev[0], float(err.max()) if err.numel() else 0.0)
    # Relative error only where the value is not tiny (else atol governs).
    big = expected.abs() > 1e-3
    stats["max_rel"] = max(prev[1], float(rel[big].max()) if big.any() else 0.0)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t
