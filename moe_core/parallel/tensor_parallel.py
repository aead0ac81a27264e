"""Tensor-parallel building blocks on DTensor, for any model: a column split of a fused gated linear, and
parameters distributed without a broadcast. The GPT's plan, which says what is split how, lives beside the
model (``moe_core.models.tp_plan``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


class GatedColwiseParallel(ParallelStyle):
    """Column split of a fused gated fc1 (an ``nn.Linear`` with [gate; up] rows): each rank holds [gate_r; up_r]
    (``_StridedShard(0, split_factor=2)``), so its local output is [..., gate_r | up_r], which the gated
    activation splits in halves as it does unsplit.

    The input (split over ``input_layouts``' token dimension) is all-gathered over the TP group, its gradient
    reduce-scattered (``Partial`` -> the input's placement, explicit), and the matmul runs on the local weight:
    DTensor's operator rules for a ``_StridedShard`` operand are not relied on. Returns the local output.
    """

    def __init__(self, *, input_layouts: Placement) -> None:
        super().__init__()
        self.input_layout = input_layouts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"module: GatedColwiseParallel splits an nn.Linear, got {type(module).__name__}")
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, _distribute(param, device_mesh, [_StridedShard(0, split_factor=2)]))
        module.forward = functools.partial(_gated_fc1_forward, module, device_mesh, self.input_layout)
        return module


def _gated_fc1_forward(module: nn.Linear, mesh: DeviceMesh, input_layout: Placement, x: torch.Tensor) -> torch.Tensor:
    x_full = DTensor.from_local(x, mesh, [input_layout], run_check=False).redistribute(mesh, [Replicate()])
    x_full = x_full.to_local(grad_placements=[Partial()])
    bias = None if module.bias is None else module.bias.to_local()
    return F.linear(x_full, module.weight.to_local(), bias)


def _distribute(param: nn.Parameter, mesh: DeviceMesh, placements: Sequence[Placement]) -> nn.Parameter:
    # src_data_rank=None: every rank slices its own copy (all ranks hold the same values, or meta tensors).
    return nn.Parameter(distribute_tensor(param.data, mesh, placements, src_data_rank=None),
                        requires_grad=param.requires_grad)


def distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Sequence[Placement]]) -> None:
    """Replace ``module``'s direct parameters named in ``placements`` by DTensors of ``mesh``."""
    for name, param_placements in placements.items():
        param = getattr(module, name)
        if param is not None:
            module.register_parameter(name, _distribute(param, mesh, param_placements))


def slice_locally(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with every style slicing each rank's own copy of a weight (every rank holds the same values, or
    meta tensors) instead of broadcasting rank 0's."""
    for style in plan.values():
        style.src_data_rank = None
    return plan


__all__ = ["GatedColwiseParallel", "distribute_params", "slice_locally"]
