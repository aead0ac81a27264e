"""What each parameter of a ``GPTModel`` is: the one place that knows the model's structure.

Everything that treats parameters by kind asks here, and this module decides by module type, never by name:
the checkpoint layout (single-process names, stacked experts, gated halves), the initialisation, the TP plan
(``tp_plan``) and the data-parallel wrappers (``model_parts``).

Legend (docs/design.md): L local experts, H hidden, F ffn width (2F for a gated ``linear_fc1``), V vocabulary,
Nq / Nkv query / key-value heads, D head dim. ``tp_dim`` and ``section_dim`` by module type:

    module                    parameter              shape                tp_dim  section_dim (gated)
    GPTModel                  embedding.weight       [V, H]               0
                              output_layer.weight    [V, H]               0
    SelfAttention             linear_qkv.weight      [(Nq + 2 Nkv) D, H]  0
                              linear_qkv.bias        [(Nq + 2 Nkv) D]     0
                              linear_proj.weight     [H, Nq D]            1
    MLP (dense, shared        linear_fc1.weight      [2F, H]              0       0
    expert, SequentialMLP     linear_fc1.bias        [2F]                 0
    expert)                   linear_fc2.weight      [H, F]               1
    GroupedMLP (stacked       linear_fc1.weight      [L, H, 2F]           2       2
    experts)                  linear_fc1.bias        [L, 2F]              1
                              linear_fc2.weight      [L, F, H]            1

Every other parameter (norms, the router, the shared expert's gate, row-split biases) is whole on every TP
rank. ``GroupedMLP`` and ``SequentialMLP`` hold the routed experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from moe_core.config import GATED_ACTIVATIONS, TransformerConfig
from moe_core.mlp import MLP
from moe_core.models.attention import SelfAttention
from moe_core.models.gpt import GPTModel
from moe_core.models.transformer_block import TransformerLayer
from moe_core.moe.experts import GroupedMLP, SequentialMLP
from moe_core.parallel.fsdp import ModelParts
from moe_core.parallel.process_groups import ProcessGroupCollection


@dataclass(frozen=True)
class ParamRole:
    """One parameter's role, the same in every process layout.

    Attributes:
        name: the single-process name (the one-process model's, as checkpoints and ``init_weights``' seeds use
            it): a ``SequentialMLP`` expert's global index in place of its local one; else the parameter's name.
        expert: a routed expert's parameter: EP splits the experts over ranks, expert-DP reduces their gradients.
        stacked: dim 0 indexes experts (``GroupedMLP``: this rank's L of the single-process E).
        section_dim: the dim holding a gated ``linear_fc1``'s ``[gate; up]`` halves (gate first), or None.
        tp_dim: the dim tensor parallelism splits (expert TP for an expert), or None: whole on every TP rank.
        former_name: the single-process name in checkpoints whose ``GroupedMLP`` linears are named ``fc1`` /
            ``fc2``; None for every other parameter.
    """

    name: str
    expert: bool = False
    stacked: bool = False
    section_dim: int | None = None
    tp_dim: int | None = None
    former_name: str | None = None


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _gated(module: MLP | GroupedMLP) -> bool:
    return module.activation_func in GATED_ACTIVATIONS


def _column_then_row(first: str, second: str, *, out_dim: int, in_dim: int, bias_out_dim: int, gated: bool
                     ) -> dict[str, dict]:
    """A column-split linear ``first`` feeding a row-split ``second``: weights with output features in
    ``out_dim`` and input features in ``in_dim``, biases with output features in ``bias_out_dim``."""
    return {f"{first}.weight": {"tp_dim": out_dim, "section_dim": out_dim if gated else None},
            f"{first}.bias": {"tp_dim": bias_out_dim},
            f"{second}.weight": {"tp_dim": in_dim}}


def _splits(module: nn.Module) -> dict[str, dict]:
    """``{parameter path under module: ParamRole fields}`` for the splits ``module``'s type fixes."""
    if isinstance(module, GroupedMLP):  # weights [L, in, out], biases [L, out]
        return _column_then_row("linear_fc1", "linear_fc2", out_dim=2, in_dim=1, bias_out_dim=1,
                                gated=_gated(module))
    if isinstance(module, MLP):  # nn.Linear: weights [out, in], biases [out]
        return _column_then_row("linear_fc1", "linear_fc2", out_dim=0, in_dim=1, bias_out_dim=0,
                                gated=_gated(module))
    if isinstance(module, SelfAttention):
        return _column_then_row("linear_qkv", "linear_proj", out_dim=0, in_dim=1, bias_out_dim=0, gated=False)
    if isinstance(module, GPTModel):  # vocabulary rows
        return {"embedding.weight": {"tp_dim": 0}, "output_layer.weight": {"tp_dim": 0}}
    return {}


def _experts(module: nn.Module, expert_offset: int) -> dict[str, dict]:
    """``{parameter path under module: ParamRole fields}`` of a module holding routed experts."""
    if isinstance(module, GroupedMLP):
        return {f"{linear}.{param}": {"expert": True, "stacked": True, "former_name": f"{former}.{param}"}
                for linear, former in (("linear_fc1", "fc1"), ("linear_fc2", "fc2"))
                for param, _ in getattr(module, linear).named_parameters()}
    if isinstance(module, SequentialMLP):  # local expert l is global expert expert_offset + l
        return {f"local_experts.{local}.{param}": {"expert": True,
                                                   "name": f"local_experts.{expert_offset + local}.{param}"}
                for local, expert in enumerate(module.local_experts) for param, _ in expert.named_parameters()}
    return {}


def param_roles(model: nn.Module, expert_offset: int = 0) -> dict[str, ParamRole]:
    """The ``ParamRole`` of every parameter of ``model``, by its name in ``model.named_parameters()``.

    Args:
        model: a ``GPTModel`` or any of its modules (an ``MoELayer``, a ``TransformerLayer``), in any layout:
            split by TP, holding this EP rank's experts, wrapped by FSDP2 or replicate. Parameters of module
            types this module does not know (another model's) are whole, dense and keep their names.
        expert_offset: the global index of this rank's first expert (``expert_offset``; 0 without EP).
    """
    roles = {name: ParamRole(name) for name, _ in model.named_parameters()}
    for prefix, module in model.named_modules():
        for table in (_splits(module), _experts(module, expert_offset)):
            for path, fields in table.items():
                name = _join(prefix, path)
                if name in roles:
                    named = {key: _join(prefix, fields[key]) for key in ("name", "former_name") if key in fields}
                    roles[name] = dataclasses.replace(roles[name], **{**fields, **named})
    return roles


def expert_offset(config: TransformerConfig | None, pg_collection: ProcessGroupCollection | None) -> int:
    """The global index of this EP rank's first expert: ``ep_rank * E / EP``; 0 without EP or experts."""
    if pg_collection is None or config is None or config.num_moe_experts is None:
        return 0
    return pg_collection.local_expert_indices(config.num_moe_experts)[0]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding routed experts (``GroupedMLP``, ``SequentialMLP``), in depth order."""
    return [module for module in model.modules() if isinstance(module, (GroupedMLP, SequentialMLP))]


def model_parts(model: nn.Module) -> ModelParts:
    """What ``parallel.apply_fsdp2`` / ``apply_ddp`` need of ``model`` (a ``GPTModel``): its
    ``TransformerLayer`` blocks, its experts and the gated ``nn.Linear`` weights (halves on dim 0)."""
    return ModelParts(blocks=tuple(m for m in model.modules() if isinstance(m, TransformerLayer)),
                      experts=tuple(expert_modules(model)),
                      dim0_halves=frozenset(name for name, role in param_roles(model).items()
                                            if role.section_dim == 0))


__all__ = ["ParamRole", "param_roles", "expert_offset", "expert_modules", "model_parts"]
