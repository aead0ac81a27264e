"""Start-up of a training process under torchrun (or alone) and per-rank data sharding."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from moe_core.parallel.process_groups import (
    ProcessGroupCollection,
    build_process_groups,
    check_expert_split,
    check_parallel_sizes,
)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def init_distributed(expert_model_parallel_size: int = 1, *, tensor_model_parallel_size: int = 1,
                     expert_tensor_parallel_size: int | None = None, num_moe_experts: int | None = None,
                     backend: str | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT
                     ) -> ProcessGroupCollection | None:
    """Initialise torch.distributed from torchrun's environment and build the TP / DP / EP groups
    (``build_process_groups``).

    Returns ``None`` for a single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) with EP and TP 1: the
    single-rank path, no process group. An already initialised default group is reused. Backend: ``backend``, else
    ``MOE_CORE_BACKEND``, else NCCL when CUDA is available and gloo otherwise; under NCCL each rank uses
    ``cuda:LOCAL_RANK``.

    ``timeout``: of the rendezvous and of every collective of every group, the default one included
    (Megatron's --distributed-timeout-minutes, same default). A collective that waits longer for a stuck or
    stopped rank fails (``moe_core.parallel.collective_errors``) instead of hanging for torch's default of
    10 minutes (NCCL) or 30 (gloo).

    Raises:
        ValueError: sizes do not divide (checked on every rank before any collective), EP or TP > 1 without
            enough processes, or a timeout that is not positive.
    """
    if not timeout > datetime.timedelta(0):
        raise ValueError(f"timeout: expected a positive timedelta, got {timeout}")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if num_moe_experts is not None:
        check_expert_split(num_moe_experts, expert_model_parallel_size)
    for name, size in (("expert_model_parallel_size", expert_model_parallel_size),
                       ("tensor_model_parallel_size", tensor_model_parallel_size)):
        if isinstance(size, int) and size > 0 and world % size:
            raise ValueError(f"{name} ({size}) must divide the number of processes ({world}); launch with "
                             "torchrun --nproc-per-node")
    check_parallel_sizes(world, expert_model_parallel_size, tensor_model_parallel_size, expert_tensor_parallel_size)
    if world == 1 and not dist.is_initialized():
        return None
    backend = backend or os.environ.get("MOE_CORE_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    pg_collection = build_process_groups(
        expert_model_parallel_size, tensor_model_parallel_size=tensor_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size, num_moe_experts=num_moe_experts)
    # DeviceMesh creates its subgroups with torch's default timeout, not the default group's: set it on each.
    groups = (pg_collection.dp, pg_collection.ep, pg_collection.expt_dp, pg_collection.tp, pg_collection.expt_tp)
    for group in {g for g in groups if g is not None}:
        _set_pg_timeout(timeout, group)
    return pg_collection


def destroy_distributed() -> None:
    """Release the process's CUDA graphs (``enable_cuda_graph``), then destroy the default process group.

    Graphs that captured collectives hold up the process group's teardown, so they go first (torch's
    ``reset_cudagraph_trees``; a no-op where none were recorded). Call it where ``init_distributed`` returned groups.
    """
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    dist.destroy_process_group()


def rank_slice(global_batch_size: int, pg_collection: ProcessGroupCollection | None) -> slice:
    """The rows of a global batch that this DP rank trains on: contiguous, distinct per DP rank (the TP ranks
    of a DP rank share them).

    Raises:
        ValueError: ``global_batch_size`` is not a multiple of the DP size.
    """
    size = 1 if pg_collection is None else pg_collection.dp_size
    rank = 0 if pg_collection is None else pg_collection.dp_rank
    if global_batch_size % size:
        raise ValueError(f"global_batch_size ({global_batch_size}) must be a multiple of the DP size ({size})")
    per_rank = global_batch_size // size
    return slice(rank * per_rank, (rank + 1) * per_rank)


__all__ = ["init_distributed", "rank_slice"]
