"""Shared expert (Megatron's ``SharedExpertMLP``): a dense MLP every token passes through, optionally gated.

DeepSeekMoE (Dai et al., 2024) introduced shared experts; Qwen2-MoE gates them with
``sigmoid(hidden @ gate_weight^T)`` per token.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.mlp import MLP
from moe_core.parallel.tp_weights import tp_full


class SharedExpertMLP(MLP):
    """Dense MLP of width ``moe_shared_expert_intermediate_size`` applied to every token, optionally gated.

    ``forward(hidden [..., H]) -> [..., H]`` in hidden's dtype: ``MLP(hidden)``, times
    ``sigmoid(hidden @ gate_weight^T)`` (one scalar per token) when ``moe_shared_expert_gate``.
    Parameters: ``linear_fc1`` / ``linear_fc2`` (nn.Linear, same init as ``MLP``) and ``gate_weight`` [1, H]
    (normal(0, init_method_std)) when gated, else ``gate_weight`` is None.

    Under TP (``moe_core.parallel.tensor_parallel``) fc1 and fc2 gather and scatter the tokens themselves:
    ``hidden`` and the output are this rank's tokens, and the gate (a replicated weight) is computed on them,
    its gradient reduced over the TP group where it is read (``tp_weights.tp_full``).

    Raises:
        ValueError: ``config.moe_shared_expert_intermediate_size`` is None.
    """

    def __init__(self, config: TransformerConfig):
        if config.moe_shared_expert_intermediate_size is None:
            raise ValueError("config.moe_shared_expert_intermediate_size: expected an int, got None")
        super().__init__(config, config.moe_shared_expert_intermediate_size)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size))
            nn.init.normal_(self.gate_weight, mean=0.0, std=config.init_method_std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(hidden @ tp_full(self.gate_weight).t())
        return out

__all__ = ["SharedExpertMLP"]
