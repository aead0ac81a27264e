"""FSDP2 (``fully_shard``) for MoE models: dense parameters over the DP mesh, experts over the expert-DP mesh.

torchtitan's layout (torchtitan/models/llama4/infra/parallelize.py): per transformer block, first
``fully_shard(block.<...>.experts, mesh=expt_dp_mesh)``, then ``fully_shard(block, mesh=dp_mesh)``, then the
root. Expert parameters hold different experts on each EP rank, so they may only be sharded and reduced
among the ranks holding the *same* experts (expert-DP); dense parameters over all ranks.

Gradients are *summed*, never averaged: the loss is already divided by the global token count
(``moe_core.parallel.loss``), and averaging would scale dense gradients by 1/dp and expert gradients by
1/expt_dp, a mismatch whenever ep > 1. Sum reduction also avoids PREMUL_SUM, which gloo lacks.

With tensor parallelism the parameters are already DTensors of the TP (or ETP) mesh and FSDP2 shards them
further over the DP (or expert-DP) mesh, which must share their root mesh (``process_groups``). It
redistributes a ``Partial`` TP gradient (a SequenceParallel norm's) to the parameter's ``Replicate`` before
reducing over DP. A gated fc1 weight is sharded on its input dimension (``fsdp_shard_placement``).

FSDP2 reduce-scatters the gradients of every parameter of a group together; it needs every rank to produce
a gradient for the same parameters. moe_core's experts always run every local expert (zero rows included),
so an expert that saw no token gets an exact zero gradient instead of none (the failure in the transformers
FSDP2 report in docs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moe_core.parallel.process_groups import ProcessGroupCollection


@dataclass(frozen=True)
class ModelParts:
    """The parts of a model the data-parallel wrappers treat differently. The model's owner names them
    (``moe_core.models.param_roles.model_parts`` for a ``GPTModel``); nothing here reads parameter names.

    Attributes:
        blocks: the transformer blocks, each wrapped on the DP mesh (then the root).
        experts: the modules holding routed experts, each inside one block: wrapped on the expert-DP mesh.
        dim0_halves: names of the parameters whose dim 0 holds a gated linear's ``[gate; up]`` halves
            (``fsdp_shard_placement``).
    """

    blocks: tuple[nn.Module, ...]
    experts: tuple[nn.Module, ...]
    dim0_halves: frozenset[str] = frozenset()


def split_expert_params(model: nn.Module, experts: Iterable[nn.Module]) -> tuple[list[nn.Parameter],
                                                                                 list[nn.Parameter]]:
    """``(dense_params, expert_params)`` of ``model``, the expert ones those of the modules ``experts`` (call
    again after wrapping: wrappers swap parameters)."""
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    expert = [p for p in model.parameters() if id(p) in expert_ids]
    return dense, expert


def wrap_per_block(model: nn.Module, pg_collection: ProcessGroupCollection, wrap: Callable[..., nn.Module],
                   parts: ModelParts, *, wrap_lone_experts: bool = True, **wrap_kwargs) -> nn.Module:
    """Apply ``wrap`` (``fully_shard`` or FSDP2's ``replicate``) per block of ``parts``: the block's experts on
    the expert-DP mesh, the block on the DP mesh, then the root; set sum reduction on every resulting module.

    ``wrap_lone_experts=False``: where the expert-DP mesh has one rank, the experts are not wrapped and the
    blocks' and root's wraps ignore their parameters, which stay as they are (plain tensors, or TP DTensors),
    marked ``allreduce = False`` (Megatron's mark of an expert parameter: ``grad_clip`` refuses them as dense)."""
    lone = not wrap_lone_experts and pg_collection.expt_dp_mesh.size() == 1
    ignored: set[nn.Parameter] = set()
    for block in parts.blocks:
        in_block = {id(m) for m in block.modules()}
        for experts in (m for m in parts.experts if id(m) in in_block):
            if lone:
                for param in experts.parameters():
                    param.allreduce = False
                    ignored.add(param)
            else:
                wrap(experts, mesh=pg_collection.expt_dp_mesh, **wrap_kwargs)
        wrap(block, mesh=pg_collection.dp_mesh, ignored_params=ignored or None, **wrap_kwargs)
    wrap(model, mesh=pg_collection.dp_mesh, ignored_params=ignored or None, **wrap_kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def fsdp_shard_placement(model: nn.Module, dim0_halves: Iterable[str]) -> Callable[[torch.Tensor], Shard | None]:
    """FSDP2's ``shard_placement_fn`` for ``model``: dim 0 (None, FSDP2's default) for every parameter but those
    named in ``dim0_halves`` (an ``nn.Linear`` weight ``[gate; up]`` of a gated linear), sharded on dim 1, their
    input: then every shard holds matching rows of both halves, in every layout. A dim-0 shard would cut across
    the halves, and under TP the rows are ``[gate_r; up_r]`` already (``_StridedShard``), which FSDP2 cannot
    describe split again on dim 0 (checkpoints save the halves as an axis of their own, ``checkpoint_layout``).
    """
    names = set(dim0_halves)
    halves = {id(p) for name, p in model.named_parameters() if name in names}

    def placement(param: torch.Tensor) -> Shard | None:
        return Shard(1) if id(param) in halves else None

    return placement


def apply_fsdp2(model: nn.Module, pg_collection: ProcessGroupCollection, parts: ModelParts, *,
                mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place with FSDP2 for EP training (Megatron's ``--use-torch-fsdp2``).

    Args:
        model: the model, whose blocks and experts ``parts`` names.
        pg_collection: the process groups (``dp_mesh``, ``expt_dp_mesh``).
        parts: the blocks, experts and gated weights of ``model`` (``ModelParts``).
        mp_policy: FSDP2 mixed precision (e.g. bf16 params, fp32 reduce); default full precision.
        reshard_after_forward: free unsharded parameters after forward (ZeRO-3) or keep them (ZeRO-2).
    Returns:
        ``model``; parameters become DTensors (Shard(0) on their mesh), gradients are summed.
    """
    kwargs = {"reshard_after_forward": reshard_after_forward,
              "shard_placement_fn": fsdp_shard_placement(model, parts.dim0_halves)}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    return wrap_per_block(model, pg_collection, fully_shard, parts, **kwargs)


__all__ = ["ModelParts", "apply_fsdp2", "fsdp_shard_placement", "split_expert_params", "wrap_per_block"]
