"""Moving parameters between the single-process layout (all E experts) and an EP layout (E / ep per rank).

Expert parameters are those of the ``experts`` modules (``fsdp.find_expert_modules``); their dim 0 is the
expert index, and EP rank r holds rows ``[r * L, (r + 1) * L)``. Everything else is replicated.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moe_core.parallel.collectives import all_gather_first_dim
from moe_core.parallel.fsdp import find_expert_modules
from moe_core.parallel.process_groups import ProcessGroupCollection

_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def global_param_name(name: str, expert_offset: int) -> str:
    """The single-process name of parameter ``name`` on a rank whose first expert has global index
    ``expert_offset``: a ``SequentialMLP`` expert's ``...local_experts.<l>...`` becomes
    ``...local_experts.<expert_offset + l>...``; every other name is unchanged."""
    return _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{expert_offset + int(m[2])}{m[3]}", name, count=1)


def expert_param_names(model: nn.Module) -> set[str]:
    """Fully qualified names of the expert parameters of ``model``."""
    expert_ids = {id(p) for m in find_expert_modules(model) for p in m.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in expert_ids}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor],
                         pg_collection: ProcessGroupCollection | None) -> None:
    """Load a single-process state dict into an unwrapped EP model: expert tensors take this rank's rows.

    Call before ``apply_fsdp2`` / ``apply_ddp``. Raises ``ValueError`` when an expert tensor's first
    dimension is not ``ep * L``.
    """
    ep_size = 1 if pg_collection is None else pg_collection.ep_size
    ep_rank = 0 if pg_collection is None else pg_collection.ep_rank
    experts = expert_param_names(model)
    params = dict(model.named_parameters())
    state = {}
    for name, value in full_state.items():
        if name in experts:
            num_local = params[name].shape[0]
            if value.shape[0] != num_local * ep_size:
                raise ValueError(f"{name}: expected {num_local * ep_size} experts in dim 0, got {tuple(value.shape)}")
            value = value[ep_rank * num_local:(ep_rank + 1) * num_local]
        state[name] = value
    model.load_state_dict(state)


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


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, pg_collection: ProcessGroupCollection | None) -> dict[str, torch.Tensor]:
    """The single-process parameters of a (wrapped) EP model, full tensors on every rank. Collective.

    DTensors (FSDP2 shards, replicate) become full tensors; expert tensors are gathered over EP.
    """
    experts = expert_param_names(model)
    out = {}
    for name, p in model.named_parameters():
        value = full_tensor(p.detach())
        if name in experts and pg_collection is not None:
            value = all_gather_first_dim(value.contiguous(), pg_collection.ep)
        out[name] = value.detach().clone()
    return out


__all__ = ["expert_param_names", "global_param_name", "load_full_state_dict", "gather_full_state_dict", "full_tensor"]
