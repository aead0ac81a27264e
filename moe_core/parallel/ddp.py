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
    its mesh (dense: all ranks, experts: expert-DP). See ``apply_fsdp2`` for the arguments.
    """
    return wrap_per_block(model, pg_collection, replicate, blocks=blocks)


__all__ = ["apply_ddp"]
