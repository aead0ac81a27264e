"""Megatron-Core layer specs with moe_core's experts: ``with_moe_core_experts`` swaps the experts builder of an MoE
spec, and ``te_grouped_mlp_with_moe_core_linears`` is Megatron's own ``TEGroupedMLP`` built on moe_core's grouped
linears.

A spec is what Megatron's spec functions return: an ``MoELayer`` ``ModuleSpec`` (a ``functools.partial`` of
``MoELayer`` in recent Megatron-Core) whose ``submodules`` are ``MoESubmodules(experts=...)``, a ``TransformerLayer``
``ModuleSpec`` holding one as its ``mlp`` (``get_gpt_layer_local_spec``,
``get_gpt_layer_with_transformer_engine_spec``), or ``TransformerBlockSubmodules`` listing layer specs
(``get_gpt_decoder_block_spec``).
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.transformer.moe import experts as megatron_experts
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from moe_core.interop.megatron_experts import MoECoreGroupedMLP
from moe_core.interop.megatron_linear import MoECoreColumnParallelGroupedLinear, MoECoreRowParallelGroupedLinear


def with_moe_core_experts(spec, experts=MoECoreGroupedMLP):
    """A copy of ``spec`` whose MoE layers build their experts with ``experts``; ``spec`` is left unchanged.

    Args:
        spec: a Megatron ``MoELayer`` or ``TransformerLayer`` spec, or ``TransformerBlockSubmodules`` (see the
            module docstring).
        experts: the experts builder, ``MoECoreGroupedMLP`` by default (or ``te_grouped_mlp_with_moe_core_linears()``).
    Raises:
        ValueError: ``spec`` holds no MoE layer (a dense MLP spec, or not a spec).
    """
    replaced = _replace_experts(spec, experts)
    if replaced is None:
        raise ValueError(f"spec: expected a Megatron MoELayer or TransformerLayer spec, or TransformerBlockSubmodules, "
                         f"with an MoE layer (built with num_experts), got {spec!r}")
    return replaced


def te_grouped_mlp_with_moe_core_linears() -> ModuleSpec:
    """An experts builder: Megatron's ``TEGroupedMLP`` with ``linear_fc1`` / ``linear_fc2`` built by
    ``MoECoreColumnParallelGroupedLinear`` / ``MoECoreRowParallelGroupedLinear`` (no TransformerEngine).

    ``TEGroupedMLP`` reads ``tokens_per_expert`` on the host (``.tolist()``); ``MoECoreGroupedMLP`` does not.
    """
    # Releases with the builder protocols type TEGroupedMLP's submodules as GroupedMLPSubmodules; the others take
    # MLPSubmodules, whose fields are the same.
    submodules = getattr(megatron_experts, "GroupedMLPSubmodules", None) or megatron_experts.MLPSubmodules
    return ModuleSpec(module=megatron_experts.TEGroupedMLP, submodules=submodules(
        linear_fc1=MoECoreColumnParallelGroupedLinear, linear_fc2=MoECoreRowParallelGroupedLinear))


def _replace_experts(spec, experts):
    """``spec`` rebuilt with ``experts`` in each ``MoESubmodules`` below it, or None where there is none."""
    if isinstance(spec, MoESubmodules):
        return dataclasses.replace(spec, experts=experts)
    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules: dense layers stay as they are
        layers = [_replace_experts(layer, experts) for layer in spec.layer_specs]
        if all(layer is None for layer in layers):
            return None
        return dataclasses.replace(spec, layer_specs=[new or old for new, old in zip(layers, spec.layer_specs,
                                                                                     strict=True)])
    if hasattr(spec, "mlp"):  # TransformerLayerSubmodules
        mlp = _replace_experts(spec.mlp, experts)
        return None if mlp is None else dataclasses.replace(spec, mlp=mlp)
    submodules = spec.keywords.get("submodules") if isinstance(spec, functools.partial) else getattr(
        spec, "submodules", None)
    replaced = None if submodules is None else _replace_experts(submodules, experts)
    return None if replaced is None else _with_submodules(spec, replaced)


def _with_submodules(spec, submodules):
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)


__all__ = ["with_moe_core_experts", "te_grouped_mlp_with_moe_core_linears"]
