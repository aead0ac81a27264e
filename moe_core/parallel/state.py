"""The whole tensor of a DTensor, including the TP splits of a gated linear that some torch releases cannot
redistribute (``_StridedShard``)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moe_core.parallel.collectives import all_gather_first_dim


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``t``: a DTensor gathered over its mesh (collective), anything else as it is.

    A DTensor holding a ``_StridedShard(d, split_factor=s)`` (a TP-split gated fc1: each rank holds its part of
    each of the ``s`` pieces of dim ``d``), with every split mesh dimension on its own tensor dimension, is
    gathered here one mesh dimension at a time; some torch releases cannot plan that redistribution. Other
    layouts use ``DTensor.full_tensor``.
    """
    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    split = [(i, p) for i, p in enumerate(t.placements) if not p.is_replicate() and mesh.size(i) > 1]
    tensor_dims = [p.dim for _, p in split if isinstance(p, (Shard, _StridedShard))]
    if (len(tensor_dims) < len(split) or len(set(tensor_dims)) < len(tensor_dims)
            or not any(isinstance(p, _StridedShard) for _, p in split)):
        return t.full_tensor()
    x = t.to_local()
    for mesh_dim, placement in split:
        x = _gather_pieces(x, placement, mesh.get_group(mesh_dim), mesh.size(mesh_dim))
    return x


def _gather_pieces(x: torch.Tensor, placement: Shard | _StridedShard, group, size: int) -> torch.Tensor:
    """Undo one mesh dimension's ``Shard`` (one piece) or ``_StridedShard`` (``split_factor`` pieces, each split
    over the ranks) of ``x`` along ``placement.dim``."""
    pieces = getattr(placement, "split_factor", 1)
    parts = all_gather_first_dim(x.movedim(placement.dim, 0).contiguous(), group).chunk(size)
    chunks = [part.chunk(pieces) for part in parts]
    return torch.cat([chunk[j] for j in range(pieces) for chunk in chunks]).movedim(0, placement.dim)


__all__ = ["full_tensor"]
