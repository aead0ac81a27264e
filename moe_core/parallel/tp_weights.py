"""How a module computes with a weight that tensor (or expert-tensor) parallelism made a DTensor.

Two cases, each stated with explicit DTensor placements:

- ``tp_full``: a weight replicated (or vocabulary-split) over the TP group, used on this rank's own tokens
  (the router, the output layer, the shared expert's gate). Its gradient on this rank covers this rank's
  tokens only: a partial sum over the TP group. It is reduced exactly once, where the weight enters the
  computation: the local gradient is declared ``Partial`` and DTensor redistributes it to the weight's own
  placement (all-reduce to ``Replicate``, reduce-scatter to ``Shard``). The torchtitan report in docs is what
  happens when such a gradient is declared ``Replicate`` instead: no reduction, and the replicas drift apart.
- ``local_shard``: a weight split over the ETP group (expert fc1 columns, fc2 rows), computed on all the rows
  of the ETP group: the local gradient is the whole gradient of the local shard, so it keeps the weight's
  placements and needs no reduction.

Plain tensors (no TP) pass through both unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate


def tp_full(weight: torch.Tensor) -> torch.Tensor:
    """The whole ``weight`` as a plain tensor, for computing on this rank's tokens; backward reduces its
    gradient over the weight's mesh.

    Args:
        weight: a plain tensor (returned as is) or a DTensor whose placements are ``Replicate`` or ``Shard``.
    Returns:
        The full tensor: no collective for ``Replicate``, an all-gather for ``Shard``. In backward the local
        gradient is taken as ``Partial`` and redistributed to ``weight``'s placements: one all-reduce
        (``Replicate``) or reduce-scatter (``Shard``) per use.
    """
    if not isinstance(weight, DTensor):
        return weight
    ndim = weight.device_mesh.ndim
    return weight.redistribute(placements=[Replicate()] * ndim).to_local(grad_placements=[Partial()] * ndim)


def local_shard(weight: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor ``weight`` (a plain tensor or None: as is). Its gradient is the whole
    gradient of the shard, with ``weight``'s placements: no collective either way."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


__all__ = ["tp_full", "local_shard"]
