"""A checkpoint's tensors in the single-process layout, as views of each rank's shards (sharded DCP).

DCP (torch.distributed.checkpoint) writes each rank's part of a DTensor at its offsets in the global tensor
and reads those parts back in any other split, so no rank ever holds a whole state dict. That needs a global
tensor that means the same in every layout: the single-process parameter (and its AdamW moments), except

- expert tensors: an EP rank holds experts ``[r * L, (r + 1) * L)`` under the same name as the other EP ranks;
  its part becomes a DTensor of the expert mesh with ``Shard(0)`` over ``ep`` (global shape ``[E, ...]``; an
  expert-DP split of FSDP2 nests inside it as ``_StridedShard``). ``SequentialMLP`` experts take their global
  index in the name instead (the single-process name of ``models.param_roles``).
- a gated fc1 weight (``[gate; up]``, gate half first): TP / ETP hold ``[gate_r; up_r]``, no contiguous block of
  it. In every layout it is saved with a section axis, ``[2, F, H]`` for an ``nn.Linear`` and ``[E, H, 2, F]`` for
  ``GroupedMLP.linear_fc1`` (Megatron's dist-checkpointing saves SwiGLU's fc1 this way), where each rank's part is
  one block (FSDP2 never splits it across the halves: ``fsdp.fsdp_shard_placement``). Its bias keeps ``[2F]``:
  TP never splits a gated bias (the config refuses biases with a gated TP MLP).

Which parameters are experts, stacked or gated, and their single-process names, come from their roles
(``models.param_roles``). A checkpoint that holds a tensor under its former name (``GroupedMLP``'s linears as
``fc1`` / ``fc2``) is read under that name (``as_saved``).

Every view shares storage with the tensor it describes (``dcp.load`` writes in place); nothing is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moe_core.models.param_roles import expert_offset, param_roles
from moe_core.parallel.process_groups import ProcessGroupCollection


@dataclass(frozen=True)
class Layout:
    """How one parameter (and its AdamW moments) is saved.

    Attributes:
        key: the single-process name. experts_split: dim 0 holds this EP rank's L of E experts (EP > 1).
        section_dim: the dim of a gated fc1's [gate; up] halves, saved as a new axis of size 2; None otherwise.
        former_key: the key older checkpoints hold it under, or None.
    """

    key: str
    experts_split: bool
    section_dim: int | None
    former_key: str | None = None


def layouts(model: nn.Module, pg_collection: ProcessGroupCollection | None) -> dict[str, Layout]:
    """The ``Layout`` of every parameter of ``model`` (a ``GPTModel`` in any layout; any other module is saved
    as it is), by its name."""
    ep = 1 if pg_collection is None else pg_collection.ep_size
    roles = param_roles(model, expert_offset(getattr(model, "config", None), pg_collection))
    return {name: Layout(role.name, role.stacked and ep > 1, role.section_dim, role.former_name)
            for name, role in roles.items()}


def as_saved(layout: dict[str, Layout], saved_keys: set[str]) -> dict[str, Layout]:
    """``layout`` with the key of each parameter that the checkpoint of model keys ``saved_keys`` holds under its
    former key only replaced by that one."""
    return {name: replace(entry, key=entry.former_key)
            if entry.key not in saved_keys and entry.former_key in saved_keys else entry
            for name, entry in layout.items()}


def _with_section(placement: Placement, dim: int) -> Placement:
    """``placement`` of a tensor whose ``dim`` became ``(2, size / 2)``."""
    if isinstance(placement, _StridedShard):
        if placement.dim != dim or placement.split_factor != 2:
            raise ValueError(f"a gated fc1 split by {placement}: expected _StridedShard({dim}, split_factor=2)")
        return Shard(dim + 1)
    if isinstance(placement, Shard):
        if placement.dim == dim:
            raise ValueError(f"a gated fc1 split by {placement} across its [gate; up] halves")
        return Shard(placement.dim + (placement.dim > dim))
    return placement


@torch.no_grad()
def checkpoint_view(tensor: torch.Tensor, layout: Layout, pg_collection: ProcessGroupCollection | None
                    ) -> torch.Tensor:
    """``tensor`` (a parameter, or a moment shaped like it; plain or DTensor) as the global single-process
    tensor of ``layout``: a DTensor whose local tensor is a view of ``tensor``'s, or ``tensor`` itself when it is
    whole and replicated on every rank.

    Raises:
        ValueError: a split this layout cannot describe as blocks (a gated fc1 split across its halves).
    """
    if isinstance(tensor, DTensor):
        local, mesh, placements = tensor.to_local(), tensor.device_mesh, list(tensor.placements)
    else:
        local, mesh, placements = tensor, None, []
    shape = list(tensor.shape)
    if layout.section_dim is not None:
        d = layout.section_dim
        local = local.unflatten(d, (2, -1))
        shape[d:d + 1] = [2, shape[d] // 2]
        placements = [_with_section(p, d) for p in placements]
    if layout.experts_split:
        names = mesh.mesh_dim_names if mesh is not None else ()
        ep = pg_collection.ep_size
        by_name = dict(zip(names, placements, strict=True))
        mesh = pg_collection.expert_mesh
        placements = []
        for dim_name in mesh.mesh_dim_names:
            p = Shard(0) if dim_name == "ep" else by_name.get(dim_name, Replicate())
            if dim_name == "expt_dp" and isinstance(p, Shard) and p.dim == 0:
                p = _StridedShard(0, split_factor=ep)  # FSDP2's split of this EP rank's block of experts
            placements.append(p)
        shape[0] *= ep
    if mesh is None:
        return local
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def model_views(model_sd: dict[str, torch.Tensor], layout: dict[str, Layout],
                pg_collection: ProcessGroupCollection | None) -> dict[str, torch.Tensor]:
    """A model state dict (parameters and persistent buffers, by name) as checkpoint views by key."""
    return {layout[name].key if name in layout else name:
            checkpoint_view(value, layout[name], pg_collection) if name in layout else value
            for name, value in model_sd.items()}


def optimizer_views(optim_state: dict[str, dict], layout: dict[str, Layout],
                    pg_collection: ProcessGroupCollection | None) -> dict[str, dict]:
    """AdamW's per-parameter state (by parameter name) as checkpoint views by key: the moments like their
    parameter, the step (a 0-dim tensor, equal everywhere) as is."""
    return {layout[name].key: {k: checkpoint_view(v, layout[name], pg_collection)
                               if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in state.items()}
            for name, state in optim_state.items()}


__all__ = ["Layout", "layouts", "as_saved", "checkpoint_view", "model_views", "optimizer_views"]
