"""Start-up of a training process under torchrun (or alone) and per-rank data sharding."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from moe_core.parallel.collective_errors import named_collective
from moe_core.parallel.process_groups import (
    ProcessGroupCollection,
    build_process_groups,
    check_expert_split,
    check_parallel_sizes,
    default_device_type,
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


def check_ranks_agree(**configs: Any) -> None:
    """Raise on every rank unless every rank of the default group holds equal ``configs`` (name -> dataclass
    instance, e.g. ``model=TransformerConfig, training=TrainingConfig``): ranks launched with different flags
    would otherwise train together on different settings. No field may differ, paths included: every rank reads
    the same data and checkpoints, and reports what rank 0 writes.

    Collective over the default group, the same on every rank: one all-gather of a SHA-256 fingerprint of the
    fields (on this rank's CUDA device under NCCL); only when the fingerprints differ, which every rank sees
    alike, one ``all_gather_object`` of the fields to name those that differ. A no-op without torch.distributed.

    Raises:
        ValueError: the configurations differ; names each differing field with its values and their ranks.
    """
    if not dist.is_initialized():
        return
    fields = {name: dataclasses.asdict(config) for name, config in configs.items()}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()
    device = torch.device("cuda", torch.cuda.current_device()) if default_device_type() == "cuda" else "cpu"
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    with named_collective("all_gather (run configuration fingerprint)"):
        dist.all_gather(gathered, mine)
    fingerprints = torch.stack(gathered).cpu()  # [world, 32]
    if (fingerprints == fingerprints[0]).all():
        return
    every_rank: list[Any] = [None] * len(gathered)
    with named_collective("all_gather_object (run configurations)"):
        dist.all_gather_object(every_rank, fields)
    differences = []
    for section, values in fields.items():
        for name in values:
            by_value: dict[str, list[int]] = {}
            for rank, other in enumerate(every_rank):
                by_value.setdefault(json.dumps(other[section][name]), []).append(rank)
            if len(by_value) > 1:
                seen = ", ".join(f"{value} on ranks {ranks}" for value, ranks in by_value.items())
                differences.append(f"{name} ({section}): {seen}")
    raise ValueError(f"rank {dist.get_rank()}: the ranks were given different run configurations; launch every rank "
                     f"with the same flags and YAML: {'; '.join(differences)}")


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


__all__ = ["init_distributed", "check_ranks_agree", "rank_slice"]
