"""Data parallelism with replicated parameters: dense gradients summed over DP, expert gradients over expert-DP.

torch's ``DistributedDataParallel`` reduces every parameter over one process group, but expert parameters
must be reduced over the ranks holding the same experts only. FSDP2's ``replicate``
(torch.distributed._composable.replicate_with_fsdp, the DDP of torchtitan's FSDP2 stack) takes a mesh per
module, so the same per-block wrapping as ``apply_fsdp2`` works: experts on the expert-DP mesh, blocks and the
root on the DP mesh. It runs on gloo (CPU) and NCCL.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate

from moe_core.parallel.fsdp import wrap_per_block
from moe_core.parallel.process_groups import ProcessGroupCollection


def apply_ddp(model: nn.Module, pg_collection: ProcessGroupCollection, *, blocks: Iterable[nn.Module] | None = None
              ) -> nn.Module:
    """Replicate ``model`` in place for EP training (Megatron's default DDP).

    Parameters become DTensors with a ``Replicate`` placement; after backward each gradient is the sum over
    its mesh (dense: all ranks, experts: expert-DP). Experts whose expert-DP mesh has one rank (``ep`` times
    ``expt_tp`` ranks span the world) have nothing to sum and stay unwrapped: ``replicate`` would copy each of
    their gradients into a reduce buffer and out again every step. Their parameters stay plain, so an optimizer
    must hold dense and expert parameters in separate groups (``training.step.build_optimizer`` does): a foreach
    or fused step over a group mixing DTensors and plain tensors raises. Call it on the allocated model (the
    ``allreduce = False`` mark of an unwrapped expert does not survive ``to_empty``). See ``apply_fsdp2`` for the
    arguments.
    """
    return wrap_per_block(model, pg_collection, replicate, blocks=blocks, wrap_lone_experts=False)


__all__ = ["apply_ddp"]
