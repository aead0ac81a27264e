"""Tensor and sequence parallelism (Megatron's TP + SP, and expert TP) on DTensor for ``GPTModel``.

Legend (docs/design.md): B batch, S sequence, T = B * S tokens, H hidden, V vocabulary, F ffn width, L local
experts, tp the TP size.

Between modules the residual stream is split by sequence over the TP group ([B, S/tp, H] on each rank:
sequence parallelism, SP). ``apply_tensor_parallel`` splits each module with torch.distributed.tensor.parallel:

    embedding            RowwiseParallel: vocabulary rows split; ids whole, output reduce-scattered to [B, S/tp, H]
    *_layernorm          SequenceParallel: weight replicated, computed on the rank's tokens
    self_attention       input all-gathered to [B, S, H]; linear_qkv ColwiseParallel (whole query groups, the
                         layout of ``qkv_row_blocks``), linear_proj RowwiseParallel reduce-scattered to [B, S/tp, H];
                         q/k_layernorm SequenceParallel over the heads dimension
    dense mlp            linear_fc1 column split (input all-gathered), linear_fc2 row split (reduce-scattered)
    mlp.shared_experts   the same on the MoE layer's flat [T/tp, H] tokens; the gate weight replicated
    mlp.router           weight replicated; each rank routes its own T/tp tokens, so no token is routed twice
    mlp.experts          ETP > 1: fc1 columns and fc2 rows split over ``expt_tp`` (``MoELayer`` gathers the
                         ETP group's tokens before dispatch and reduce-scatters after combine); ETP 1: whole
    output_layer         vocabulary rows split, gathered whole (``tp_full``) for the rank's own tokens

A gated fc1 ([gate; up] rows, gate half first) is split with ``_StridedShard`` so each rank holds
[gate_r; up_r]: the halves of its local output are its gate and up columns.

Gradients: a TP-split weight's local gradient is its shard's whole gradient. A replicated weight used on the
rank's own tokens has a partial gradient: the router, output layer and shared-expert gate reduce it where
they read the weight (``tp_weights.tp_full``: ``Partial`` -> the weight's placement, explicit); the
SequenceParallel norms' DTensor gradients come out ``Partial`` and the data-parallel wrapper (FSDP2 or
replicate) redistributes them to ``Replicate`` before its own reduction. Every dense parameter becomes a
DTensor of the TP mesh, every expert parameter under ETP one of the ETP mesh, so each optimizer group and
the gradient norm see one mesh per kind of parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from moe_core.config import TransformerConfig
from moe_core.moe.experts import GroupedMLP, SequentialMLP
from moe_core.moe.moe_layer import MoELayer
from moe_core.parallel.process_groups import ProcessGroupCollection


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


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Sequence[Placement]]) -> None:
    """Replace ``module``'s direct parameters named in ``placements`` by DTensors of ``mesh``."""
    for name, param_placements in placements.items():
        param = getattr(module, name)
        if param is not None:
            module.register_parameter(name, _distribute(param, mesh, param_placements))


def _styles(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    for style in plan.values():
        style.src_data_rank = None
    return plan


def _mlp_plan(prefix: str, gated: bool, token_dim: int) -> dict[str, ParallelStyle]:
    """fc1 split by columns with its input gathered over ``token_dim``; fc2 by rows, reduce-scattered back."""
    fc1 = GatedColwiseParallel if gated else ColwiseParallel
    return {f"{prefix}.linear_fc1": fc1(input_layouts=Shard(token_dim)),
            f"{prefix}.linear_fc2": RowwiseParallel(output_layouts=Shard(token_dim))}


def _layer_plan(layer: nn.Module, config: TransformerConfig) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": SequenceParallel(use_local_output=True),
        "pre_mlp_layernorm": SequenceParallel(use_local_output=True),
        "self_attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                             use_local_output=True),
        "self_attention.linear_qkv": ColwiseParallel(),
        "self_attention.linear_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if config.qk_layernorm:
        for norm in ("q_layernorm", "k_layernorm"):
            plan[f"self_attention.{norm}"] = SequenceParallel(sequence_dim=1, use_local_output=True)  # [B, N, S, D]
    if not isinstance(layer.mlp, MoELayer):
        plan.update(_mlp_plan("mlp", config.gated_linear_unit, token_dim=1))
    elif layer.mlp.shared_experts is not None:
        plan.update(_mlp_plan("mlp.shared_experts", config.gated_linear_unit, token_dim=0))
    return _styles(plan)


def _shard_experts(experts: nn.Module, mesh: DeviceMesh, gated: bool) -> None:
    """ETP: each expert's fc1 split by output columns (gate and up halves each), fc2 by input rows."""
    if isinstance(experts, GroupedMLP):  # fc1 [L, H, 2F or F], fc2 [L, F, H]
        _distribute_params(experts.fc1, mesh, {"weight": [_StridedShard(2, split_factor=2) if gated else Shard(2)]})
        _distribute_params(experts.fc2, mesh, {"weight": [Shard(1)]})
    elif isinstance(experts, SequentialMLP):  # nn.Linear: fc1 [2F or F, H], fc2 [H, F]
        for expert in experts.local_experts:
            _distribute_params(expert.linear_fc1, mesh,
                               {"weight": [_StridedShard(0, split_factor=2) if gated else Shard(0)]})
            _distribute_params(expert.linear_fc2, mesh, {"weight": [Shard(1)]})
    else:
        raise TypeError(f"experts: expected GroupedMLP or SequentialMLP, got {type(experts).__name__}")


def apply_tensor_parallel(model: nn.Module, pg_collection: ProcessGroupCollection | None) -> nn.Module:
    """Split ``model`` (a ``GPTModel`` built with ``pg_collection``) in place as the module docstring says.

    Call after the model holds its weights (or on the meta device) and before ``apply_fsdp2`` / ``apply_ddp``.
    A no-op at TP and ETP size 1 (or ``pg_collection`` None).

    Returns:
        ``model``.
    Raises:
        ValueError: the model's config disagrees with ``pg_collection``'s TP or ETP size.
    """
    tp_mesh = None if pg_collection is None else pg_collection.tp_mesh
    etp_mesh = None if pg_collection is None else pg_collection.expt_tp_mesh
    config = model.config
    if (1 if tp_mesh is None else tp_mesh.size()) != config.tensor_model_parallel_size or \
            (1 if etp_mesh is None else etp_mesh.size()) != config.expert_tensor_parallel_size:
        raise ValueError(
            f"pg_collection: TP / ETP sizes {pg_collection and (pg_collection.tp_size, pg_collection.expt_tp_size)} "
            f"differ from the model's tensor_model_parallel_size ({config.tensor_model_parallel_size}) / "
            f"expert_tensor_parallel_size ({config.expert_tensor_parallel_size})"
        )
    if tp_mesh is not None:
        parallelize_module(model, tp_mesh, _styles({
            "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "decoder.final_layernorm": SequenceParallel(use_local_output=True),
        }))
        if model.output_layer is not None:
            _distribute_params(model.output_layer, tp_mesh, {"weight": [Shard(0)]})
        for layer in model.decoder.layers:
            parallelize_module(layer, tp_mesh, _layer_plan(layer, config))
            if isinstance(layer.mlp, MoELayer):
                _distribute_params(layer.mlp.router, tp_mesh, {"weight": [Replicate()]})
                if layer.mlp.shared_experts is not None:
                    _distribute_params(layer.mlp.shared_experts, tp_mesh, {"gate_weight": [Replicate()]})
    if etp_mesh is not None:
        for layer in model.decoder.layers:
            if isinstance(layer.mlp, MoELayer):
                _shard_experts(layer.mlp.experts, etp_mesh, config.gated_linear_unit)
    return model


__all__ = ["GatedColwiseParallel", "apply_tensor_parallel"]
