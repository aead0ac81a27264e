"""Shared expert (Megatron's ``SharedExpertMLP``): a dense MLP every token passes through, optionally gated,
optionally overlapped with the dispatcher's communication.

DeepSeekMoE (Dai et al., 2024) introduced shared experts; Qwen2-MoE gates them with
``sigmoid(hidden @ gate_weight^T)`` per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.mlp import MLP
from moe_core.moe.moe_utils import side_stream
from moe_core.parallel.tp_weights import tp_full
from moe_core.recompute import checkpoint


class SharedExpertMLP(MLP):
    """Dense MLP of width ``moe_shared_expert_intermediate_size`` applied to every token, optionally gated.

    ``forward(hidden [..., H]) -> [..., H]`` in hidden's dtype: ``MLP(hidden)``, times
    ``sigmoid(hidden @ gate_weight^T)`` (one scalar per token) when ``moe_shared_expert_gate``.
    Parameters: ``linear_fc1`` / ``linear_fc2`` (nn.Linear, same init as ``MLP``) and ``gate_weight`` [1, H]
    (normal(0, init_method_std)) when gated, else ``gate_weight`` is None.

    ``start(hidden)`` runs the same forward so that it can overlap the dispatcher's all-to-all
    (``moe_shared_expert_overlap``); attribute ``overlap`` says whether it will, where CUDA allows.
    Under TP (``moe_core.models.tp_plan``) fc1 and fc2 gather and scatter the tokens themselves:
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
        # Only EP dispatchers communicate: with one EP rank there is nothing to overlap.
        self.overlap = bool(config.moe_shared_expert_overlap) and config.expert_model_parallel_size > 1
        self.recompute = config.recomputes("shared_experts")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return checkpoint(self._forward, hidden)
        return self._forward(hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(hidden @ tp_full(self.gate_weight).t())
        return out

    def start(self, hidden: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start ``forward(hidden)``; the returned function gives its output, ready on the current stream.

        With ``overlap`` and a CUDA ``hidden`` (Megatron's ``moe_shared_expert_overlap``) the forward is queued on
        a side CUDA stream after the work already queued, so the GPU runs it while the caller's next work, the
        dispatcher's permute and all-to-all, is in flight; the function makes the current stream wait for it
        (an event, no host sync). Autograd runs the backward on the same side stream, so it overlaps the
        dispatcher's backward too. Otherwise, and under torch.compile (the side stream would break the graph;
        there the compiled graph orders the work), the forward runs here, in order, and the function returns it.
        """
        if not (self.overlap and hidden.is_cuda) or torch.compiler.is_compiling():
            out = self(hidden)
            return lambda: out
        return self._start_on_side_stream(hidden)

    @torch.compiler.disable
    def _start_on_side_stream(self, hidden: torch.Tensor) -> Callable[[], torch.Tensor]:
        main = torch.cuda.current_stream(hidden.device)
        side = side_stream(hidden.device, "shared_expert")
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = self(hidden)
        hidden.record_stream(side)  # the caller may free hidden while the side stream still reads it

        @torch.compiler.disable
        def result() -> torch.Tensor:
            main.wait_stream(side)
            out.record_stream(main)  # allocated on the side stream, used from now on on the main one
            return out

        return result


__all__ = ["SharedExpertMLP"]
