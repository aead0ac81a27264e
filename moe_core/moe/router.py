"""TopKRouter: scores, top-k selection, load-balancing losses and capacity dropping.

Legend: B batch, S sequence, N = B * S tokens, H hidden, E experts, K = moe_router_topk.

Follows Megatron-LM's ``TopKRouter`` and ``topk_routing_with_score_function`` (megatron/core/transformer/moe/
router.py, moe_utils.py): softmax (top-k then softmax, or pre-softmax) or sigmoid scores, group-limited
top-k (DeepSeek-V2/V3), aux-loss-free expert bias (DeepSeek-V3, Wang et al. 2024), the Switch / sequence /
global load-balancing losses and the ST-MoE z-loss, input jitter (Switch) and capacity dropping.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.moe.load_balancing import (
    MoEAuxLossAutoScaler,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    z_loss,
)
from moe_core.moe.moe_utils import apply_token_dropping, get_capacity

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, None: None}


class TopKRouter(nn.Module):
    """Route each token to ``moe_router_topk`` of ``num_moe_experts`` experts.

    Args:
        config: ``TransformerConfig`` (the ``moe_router_*``, ``moe_aux_loss_coeff``, ``moe_z_loss_coeff``,
            ``moe_input_jitter_eps`` and capacity fields).
        tp_dp_group: process group over which ``global_aux_loss`` sums its token counts (the ranks that
            see different tokens: DP x EP); None counts this process's tokens only.

    Attributes:
        weight: ``[E, H]`` router weight.
        expert_bias: ``[E]`` float32 buffer, added to the scores for selection only (when enabled).
        local_tokens_per_expert: ``[E]`` float32 buffer, rows routed per expert since the last
            ``update_expert_bias()``. Under data parallelism all-reduce it (sum) before that call.
        aux_loss_scale: gradient of each aux loss in backward; the trainer sets it to the factor its main
            loss carries (e.g. 1 / micro-batches).
        aux_losses: after each forward, the detached loss values that entered the graph (coefficients
            applied), keyed ``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``, ``z_loss``.
        tokens_per_expert: after each forward, ``[E]`` detached rows per expert (after dropping), for logging.
    """

    def __init__(self, config: TransformerConfig, tp_dp_group: dist.ProcessGroup | None = None):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("config.num_moe_experts: TopKRouter needs a number of experts, got None")
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.tp_dp_group = tp_dp_group
        self.router_dtype = _ROUTER_DTYPES[config.moe_router_dtype]
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, mean=0.0, std=config.init_method_std)
        types = config.moe_router_load_balancing_type
        coeffs = config.moe_aux_loss_coeff
        pairs = zip(types, coeffs) if isinstance(types, list) else [(types, coeffs)]
        self.aux_loss_coeffs = {t: float(c) for t, c in pairs if t != "none" and c}
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=config.moe_router_enable_expert_bias)
        self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=False)
        self.register_buffer("global_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=False)
        self.register_buffer("global_num_tokens", torch.zeros((), dtype=torch.float32), persistent=False)
        self.aux_loss_scale = 1.0
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.tokens_per_expert = torch.zeros(self.num_experts)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``hidden``.

        Args:
            hidden: ``[B, S, H]`` (batch-first; the sequence loss is per sequence) or ``[N, H]`` (one sequence).
        Returns:
            ``probs`` ``[N, E]`` float32, the weight of each selected expert and 0 elsewhere, and
            ``routing_map`` ``[N, E]`` bool. Aux losses are attached to ``probs``'s graph.
        Raises:
            ValueError: ``hidden``'s last dimension is not ``hidden_size`` or its rank is not 2 or 3.
        """
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"hidden: expected [B, S, {self.weight.shape[1]}] or [N, {self.weight.shape[1]}], got {tuple(hidden.shape)}"
            )
        seq_shape = hidden.shape[:-1] if hidden.dim() == 3 else (1, hidden.shape[0])
        hidden_NH = hidden.reshape(-1, hidden.shape[-1])
        logits_NE = self._logits(hidden_NH)
        probs_NE, routing_map_NE = self._topk_routing(logits_NE)
        losses = self._losses(logits_NE, routing_map_NE, seq_shape)
        if self.config.moe_expert_capacity_factor is not None:
            capacity = get_capacity(hidden_NH.shape[0] * self.topk, self.num_experts,
                                    self.config.moe_expert_capacity_factor)
            probs_NE, routing_map_NE = apply_token_dropping(
                probs_NE, routing_map_NE, capacity, self.config.moe_token_drop_policy,
                self.config.moe_pad_expert_input_to_capacity,
            )
        aux_total = sum((v for k, v in losses.items() if k != "z_loss"), torch.zeros((), device=hidden.device))
        if aux_total.requires_grad:
            probs_NE = MoEAuxLossAutoScaler.apply(probs_NE, aux_total, self.aux_loss_scale)
        self.aux_losses = {k: v.detach() for k, v in losses.items()}
        with torch.no_grad():
            routed = routing_map_NE.sum(dim=0).float()
            self.tokens_per_expert = routed
            if self.training:
                self.local_tokens_per_expert += routed
        return probs_NE.float(), routing_map_NE

    def _logits(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        eps = self.config.moe_input_jitter_eps
        if self.training and eps:
            hidden_NH = hidden_NH * torch.empty_like(hidden_NH).uniform_(1.0 - eps, 1.0 + eps)
        dtype = self.router_dtype or hidden_NH.dtype
        logits_NE = hidden_NH.to(dtype) @ self.weight.to(dtype).t()
        coeff = self.config.moe_z_loss_coeff
        if coeff and self.training and logits_NE.requires_grad:
            loss = z_loss(logits_NE, coeff)
            self._z_loss = loss
            logits_NE = MoEAuxLossAutoScaler.apply(logits_NE, loss, self.aux_loss_scale)
        else:
            self._z_loss = None
        return logits_NE

    def _topk_routing(self, logits_NE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        if cfg.moe_router_score_function == "sigmoid":
            scores_NE = torch.sigmoid(logits_NE)
        elif cfg.moe_router_pre_softmax:
            scores_NE = torch.softmax(logits_NE, dim=-1)
        else:
            scores_NE = logits_NE  # select on logits, softmax over the selected ones (Mixtral)
        selection_NE = scores_NE
        if cfg.moe_router_enable_expert_bias:
            selection_NE = scores_NE + self.expert_bias.to(scores_NE.dtype)
        top_idx_NK = self._select(selection_NE)
        top_NK = scores_NE.gather(1, top_idx_NK)
        if cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax:
            top_NK = torch.softmax(top_NK, dim=-1)
        elif cfg.moe_router_score_function == "sigmoid" and self.topk > 1:
            top_NK = top_NK / (top_NK.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.moe_router_topk_scaling_factor is not None:
            top_NK = top_NK * cfg.moe_router_topk_scaling_factor
        probs_NE = torch.zeros_like(scores_NE).scatter(1, top_idx_NK, top_NK)
        routing_map_NE = torch.zeros_like(scores_NE, dtype=torch.bool).scatter(1, top_idx_NK, True)
        return probs_NE, routing_map_NE

    def _select(self, selection_NE: torch.Tensor) -> torch.Tensor:
        """Top-k expert indices ``[N, K]``; group-limited: only experts of each token's best groups compete."""
        groups, group_topk = self.config.moe_router_num_groups, self.config.moe_router_group_topk
        if groups is None:
            return selection_NE.topk(self.topk, dim=-1).indices
        num_tokens = selection_NE.shape[0]
        grouped = selection_NE.view(num_tokens, groups, -1)
        # A group's score is the sum of its best topk / group_topk experts (DeepSeek-V3).
        per_group = max(self.topk // group_topk, 1)
        group_scores_NG = grouped.topk(per_group, dim=-1).values.sum(dim=-1)
        group_idx = group_scores_NG.topk(group_topk, dim=-1).indices
        group_mask = torch.zeros_like(group_scores_NG, dtype=torch.bool).scatter(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
        return selection_NE.masked_fill(~expert_mask, float("-inf")).topk(self.topk, dim=-1).indices

    def _aux_scores(self, logits_NE: torch.Tensor) -> torch.Tensor:
        # Every expert's score, normalised per token (Megatron's compute_routing_scores_for_aux_loss).
        if self.config.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits_NE)
            return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return torch.softmax(logits_NE, dim=-1)

    def _losses(self, logits_NE: torch.Tensor, routing_map_NE: torch.Tensor, seq_shape) -> dict[str, torch.Tensor]:
        losses: dict[str, torch.Tensor] = {}
        if self._z_loss is not None:
            losses["z_loss"] = self._z_loss
        if not self.aux_loss_coeffs or not self.training:
            return losses
        scores_NE = self._aux_scores(logits_NE)
        counts_E = routing_map_NE.sum(dim=0).float()
        num_tokens = logits_NE.shape[0]
        for kind, coeff in self.aux_loss_coeffs.items():
            if kind == "aux_loss":
                losses[kind] = switch_load_balancing_loss(scores_NE, counts_E, num_tokens, self.topk, coeff)
            elif kind == "seq_aux_loss":
                batch, seq = seq_shape
                losses[kind] = sequence_load_balancing_loss(
                    scores_NE.view(batch, seq, -1), routing_map_NE.view(batch, seq, -1), self.topk, coeff
                )
            else:
                global_counts, global_tokens = self._global_counts(counts_E, num_tokens)
                losses[kind] = switch_load_balancing_loss(scores_NE, global_counts, global_tokens, self.topk, coeff)
        return losses

    def _global_counts(self, counts_E: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts over every forward since ``reset_global_aux_loss_tracker()`` and over ``tp_dp_group``."""
        stats = torch.cat([counts_E, counts_E.new_tensor([num_tokens])])
        if self.tp_dp_group is not None:
            dist.all_reduce(stats, group=self.tp_dp_group)
        with torch.no_grad():
            self.global_tokens_per_expert += stats[:-1]
            self.global_num_tokens += stats[-1]
        return self.global_tokens_per_expert.clone(), self.global_num_tokens.clone()

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new global batch for ``global_aux_loss`` (Megatron resets it every optimizer step)."""
        self.global_tokens_per_expert.zero_()
        self.global_num_tokens.zero_()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean_load - load)``, then reset the counter.

        Call after the optimizer step, once ``local_tokens_per_expert`` holds the global batch's counts
        (all-reduced over data-parallel ranks). No-op unless ``moe_router_enable_expert_bias``.
        Source: Wang et al. 2024 (Auxiliary-Loss-Free Load Balancing), Megatron's get_updated_expert_bias.
        """
        if self.config.moe_router_enable_expert_bias:
            load = self.local_tokens_per_expert
            self.expert_bias += self.config.moe_router_bias_update_rate * torch.sign(load.mean() - load)
        self.local_tokens_per_expert.zero_()


__all__ = ["TopKRouter"]
