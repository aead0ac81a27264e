"""Moving parameters between the single-process layout (all E experts) and an EP layout (E / EP per rank).

A parameter's single-process name and whether its dim 0 indexes experts come from its role
(``param_roles``): EP rank r holds rows ``[r * L, (r + 1) * L)`` of a stacked expert tensor, a ``SequentialMLP``
expert under its global index. Everything else is replicated.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moe_core.models.param_roles import expert_offset, param_roles
from moe_core.parallel.collectives import all_gather_first_dim
from moe_core.parallel.process_groups import ProcessGroupCollection
from moe_core.parallel.state import full_tensor


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor],
                         pg_collection: ProcessGroupCollection | None) -> None:
    """Load a single-process state dict into an unwrapped EP model (a ``GPTModel`` or ``MoELayer``): each
    parameter takes the tensor of its single-process name, a stacked expert tensor this rank's rows.

    Call before ``apply_fsdp2`` / ``apply_ddp``.

    Raises:
        ValueError: ``full_state`` lacks a tensor the model holds, or an expert tensor's first dimension is not
            ``EP * L``.
    """
    ep_size = 1 if pg_collection is None else pg_collection.ep_size
    ep_rank = 0 if pg_collection is None else pg_collection.ep_rank
    roles = param_roles(model, expert_offset(getattr(model, "config", None), pg_collection))
    params = dict(model.named_parameters())
    buffers = [name for name in model.state_dict() if name not in roles]
    missing = sorted(({role.name for role in roles.values()} | set(buffers)) - set(full_state))
    if missing:
        raise ValueError(f"full_state: missing {missing}")
    state = {name: full_state[name] for name in buffers}
    for name, role in roles.items():
        value = full_state[role.name]
        if role.stacked:
            num_local = params[name].shape[0]
            if value.shape[0] != num_local * ep_size:
                raise ValueError(f"{role.name}: expected {num_local * ep_size} experts in dim 0, got "
                                 f"{tuple(value.shape)}")
            value = value[ep_rank * num_local:(ep_rank + 1) * num_local]
        state[name] = value
    model.load_state_dict(state)


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, pg_collection: ProcessGroupCollection | None) -> dict[str, torch.Tensor]:
    """The single-process parameters of a (wrapped) EP model, full tensors on every rank. Collective.

    DTensors (FSDP2 shards, replicate) become full tensors; stacked expert tensors are gathered over EP.

    Raises:
        ValueError: ``SequentialMLP`` experts under EP > 1 (each rank holds other names).
    """
    ep_size = 1 if pg_collection is None else pg_collection.ep_size
    roles = param_roles(model)
    out = {}
    for name, p in model.named_parameters():
        role = roles[name]
        if role.expert and not role.stacked and ep_size > 1:
            raise ValueError(f"model: {name} is a SequentialMLP expert; gathering those over EP is not implemented")
        value = full_tensor(p.detach())
        if role.stacked and pg_collection is not None:
            value = all_gather_first_dim(value.contiguous(), pg_collection.ep)
        out[role.name] = value.detach().clone()
    return out


__all__ = ["load_full_state_dict", "gather_full_state_dict"]
