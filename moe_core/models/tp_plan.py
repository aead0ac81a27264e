"""The GPT's tensor-parallel plan: Megatron's TP + SP, and expert TP, on DTensor for ``GPTModel``.

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
    mlp.experts          ETP > 1: linear_fc1 columns and linear_fc2 rows split over ``expt_tp`` (``MoELayer``
                         gathers the ETP group's tokens before dispatch and reduce-scatters after combine);
                         ETP 1: whole
    output_layer         vocabulary rows split, gathered whole (``tp_full``) for the rank's own tokens

The router, the shared expert's gate, the output layer and the experts are placed by their roles
(``param_roles``: ``tp_dim``, whole where None); the styles place the rest the same way. A gated linear_fc1
([gate; up] rows, gate half first) is split with ``_StridedShard`` so each rank holds [gate_r; up_r]: the halves of
its local output are its gate and up columns.

Gradients: a TP-split weight's local gradient is its shard's whole gradient. A replicated weight used on the
rank's own tokens has a partial gradient: the router, output layer and shared-expert gate reduce it where
they read the weight (``tp_weights.tp_full``: ``Partial`` -> the weight's placement, explicit); the
SequenceParallel norms' DTensor gradients come out ``Partial`` and the data-parallel wrapper (FSDP2 or
replicate) redistributes them to ``Replicate`` before its own reduction. Every dense parameter becomes a
DTensor of the TP mesh, every expert parameter under ETP one of the ETP mesh, so each optimizer group and
the gradient norm see one mesh per kind of parameter.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
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
from moe_core.models.param_roles import ParamRole, param_roles
from moe_core.moe.moe_layer import MoELayer
from moe_core.parallel.process_groups import ProcessGroupCollection
from moe_core.parallel.tensor_parallel import GatedColwiseParallel, distribute_params, slice_locally


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
    return slice_locally(plan)


def tp_placement(role: ParamRole) -> Placement:
    """The placement of a parameter with ``role`` on its TP (or ETP) mesh dimension."""
    if role.tp_dim is None:
        return Replicate()
    if role.tp_dim == role.section_dim:  # [gate_r; up_r] on each rank
        return _StridedShard(role.tp_dim, split_factor=2)
    return Shard(role.tp_dim)


def _place_by_role(model: nn.Module, roles: dict[str, ParamRole], mesh: DeviceMesh, *, experts: bool) -> None:
    """Make each parameter of ``model`` that is still a plain tensor, among the experts' (``experts``) or the
    others', a DTensor of ``mesh`` placed as its role says."""
    for prefix, module in model.named_modules():
        placements = {}
        for name, param in module.named_parameters(recurse=False):
            role = roles[f"{prefix}.{name}" if prefix else name]
            if role.expert == experts and not isinstance(param, DTensor):
                placements[name] = [tp_placement(role)]
        distribute_params(module, mesh, placements)


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
    roles = param_roles(model)
    if tp_mesh is not None:
        parallelize_module(model, tp_mesh, slice_locally({
            "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "decoder.final_layernorm": SequenceParallel(use_local_output=True),
        }))
        for layer in model.decoder.layers:
            parallelize_module(layer, tp_mesh, _layer_plan(layer, config))
        _place_by_role(model, roles, tp_mesh, experts=False)  # the output layer, routers, shared-expert gates
    if etp_mesh is not None:
        _place_by_role(model, roles, etp_mesh, experts=True)
    return model


__all__ = ["apply_tensor_parallel", "tp_placement"]
