"""MoELayer (Megatron's ``MoELayer``): router -> dispatch -> experts -> combine (+ shared expert).

Legend (docs/design.md): B batch, S sequence, T = B * S tokens, H hidden, E experts, R routed rows on this rank.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.moe.dispatcher_factory import build_token_dispatcher
from moe_core.moe.experts import GroupedMLP, SequentialMLP
from moe_core.moe.router import TopKRouter
from moe_core.moe.shared_experts import SharedExpertMLP
from moe_core.parallel.collectives import all_gather_first_dim, reduce_scatter_first_dim
from moe_core.parallel.process_groups import ProcessGroupCollection, check_ep_size, check_tp_sizes


class MoELayer(nn.Module):
    """A mixture-of-experts MLP block: ``out = combine(experts(dispatch(x))) + shared_experts(x)``, where each
    token's routed part is ``sum over its experts e of probs[e] * expert_e(x)``.

    Args:
        config: the MoE fields of ``TransformerConfig``; ``moe_grouped_gemm`` picks ``GroupedMLP`` (default)
            or ``SequentialMLP``.
        pg_collection: ``moe_core.parallel.ProcessGroupCollection`` for expert parallelism; None (or EP size
            1) keeps every expert on this rank with ``MoELocalTokenDispatcher``, otherwise
            ``moe_token_dispatcher_type`` picks the EP dispatcher (``build_token_dispatcher``). The router's
            global aux loss sums its counts over ``pg_collection.tp_dp``, its other losses over
            ``pg_collection.tp``.

    Under TP (sequence parallel) ``hidden`` is this rank's slice of the sequence: the router routes these
    tokens only. With ETP > 1 the ETP group's tokens are all-gathered after routing, every ETP rank runs them
    through its slice of each expert, and the partial outputs are reduce-scattered back to their tokens.
    Raises:
        ValueError: ``num_moe_experts`` is None or not divisible by the EP size, or the EP, TP or ETP size of
            ``pg_collection`` (1 for None) differs from the config's.

    Attributes: ``router``, ``token_dispatcher``, ``experts`` (this rank's ``num_local_experts``),
    ``shared_experts`` (or None).
    """

    def __init__(self, config: TransformerConfig, pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("config.num_moe_experts: MoELayer needs experts, got None")
        self.config = config
        ep_size = check_ep_size(config.expert_model_parallel_size, pg_collection)
        check_tp_sizes(config, pg_collection)
        if config.num_moe_experts % ep_size:
            raise ValueError(f"num_moe_experts ({config.num_moe_experts}) must be divisible by the EP size ({ep_size})")
        self.num_local_experts = config.num_moe_experts // ep_size
        pg = pg_collection
        self.router = TopKRouter(config, tp_dp_group=None if pg is None else pg.tp_dp,
                                 tp_group=None if pg is None else pg.tp)
        self.expt_tp_group = None if pg is None else pg.expt_tp
        self.token_dispatcher = build_token_dispatcher(config, pg_collection)
        experts_cls = GroupedMLP if config.moe_grouped_gemm else SequentialMLP
        self.experts = experts_cls(self.num_local_experts, config)
        self.shared_experts = SharedExpertMLP(config) if config.moe_shared_expert_intermediate_size else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[B, S, H]`` (or ``[T, H]``, or any ``[..., H]``) -> the same shape and dtype.

        Raises:
            ValueError: the last dimension is not ``hidden_size``.
        """
        if hidden.dim() < 1 or hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden: expected [..., {self.config.hidden_size}], got {tuple(hidden.shape)}")
        hidden_TH = hidden.reshape(-1, hidden.shape[-1])
        # The router takes [B, S, H] as is: its sequence aux loss needs the sequence boundaries.
        probs, routing_map = self.router(hidden if hidden.dim() == 3 else hidden_TH)
        # Started before dispatch: with moe_shared_expert_overlap it runs while the all-to-alls are in flight.
        shared_output = None if self.shared_experts is None else self.shared_experts.start(hidden_TH)
        routed_TH = hidden_TH
        if self.expt_tp_group is not None:  # ETP: the group's tokens, in rank order
            routed_TH, probs, routing_map = (all_gather_first_dim(t, self.expt_tp_group)
                                             for t in (hidden_TH, probs, routing_map))
        permuted, tokens_per_expert, permuted_probs, meta = self.token_dispatcher.dispatch(
            routed_TH, probs, routing_map)
        expert_output, _ = self.experts(permuted, tokens_per_expert, permuted_probs)
        output = self.token_dispatcher.combine(expert_output, meta)
        if self.expt_tp_group is not None:  # sum the ETP ranks' partial outputs, keep this rank's tokens
            output = reduce_scatter_first_dim(output, self.expt_tp_group)
        if shared_output is not None:
            output = output + shared_output()
        return output.view(hidden.shape)

__all__ = ["MoELayer"]
