"""TopKRouter: scores, top-k selection, load-balancing losses, expert bias and capacity dropping.

Legend (docs/design.md): B batch, S sequence, T = B * S tokens, H hidden, E experts, K = moe_router_topk,
G expert groups.

Follows Megatron-LM's ``TopKRouter`` and ``topk_routing_with_score_function`` (megatron/core/transformer/moe/
router.py, moe_utils.py): softmax (top-k then softmax, or pre-softmax) or sigmoid scores, group-limited
top-k (DeepSeek-V2/V3), aux-loss-free expert bias (Wang et al. 2024, DeepSeek-V3), the Switch / sequence /
global load-balancing losses and the ST-MoE z-loss (``load_balancing.py``), input jitter (Switch
Transformer) and capacity dropping (``capacity.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.moe.capacity import apply_token_dropping, get_capacity
from moe_core.moe.load_balancing import (
    MoEAuxLossAutoScaler,
    routing_scores_for_aux_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    z_loss,
)
from moe_core.moe.metrics import RoutingRecorder
from moe_core.ops.router_gating import router_gating_linear
from moe_core.parallel.collective_errors import named_collective
from moe_core.parallel.tp_weights import tp_full
from moe_core.recompute import is_recomputing

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, None: None}
# Kept in float32 whatever dtype the module is cast to: bf16 would round away the bias's 1e-3 steps and
# miscount large loads (Megatron's _maintain_float32_expert_bias).
_FP32_BUFFERS = ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "global_num_tokens")


def topk_indices(scores_TE: torch.Tensor, topk: int, num_groups: int | None = None,
                 group_topk: int | None = None) -> torch.Tensor:
    """Each token's K best experts; group-limited when ``num_groups`` is given (DeepSeek-V2/V3).

    Group-limited: the E experts form G groups of E / G consecutive experts; a group scores the sum of its
    best ``max(K // group_topk, 1)`` experts, each token keeps its ``group_topk`` best groups and picks its K
    experts inside them only (Megatron's ``group_limited_topk``).

    Args:
        scores_TE: ``[T, E]`` selection scores.
        topk: K.
        num_groups / group_topk: G and the groups kept per token, or None for plain top-k.
    Returns:
        ``[T, K]`` int64 expert indices.
    """
    if num_groups is None:
        return scores_TE.topk(topk, dim=-1).indices
    num_tokens, num_experts = scores_TE.shape
    scores_TGX = scores_TE.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores_TG = scores_TGX.topk(max(topk // group_topk, 1), dim=-1).values.sum(dim=-1)
    group_idx = group_scores_TG.topk(group_topk, dim=-1).indices
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter(1, group_idx, True)
    expert_mask_TE = group_mask_TG.unsqueeze(-1).expand_as(scores_TGX).reshape(num_tokens, num_experts)
    return scores_TE.masked_fill(~expert_mask_TE, float("-inf")).topk(topk, dim=-1).indices


class TopKRouter(nn.Module):
    """Route each token to ``moe_router_topk`` of ``num_moe_experts`` experts.

    Knobs (``TransformerConfig``, Megatron's names): ``moe_router_score_function``, ``moe_router_pre_softmax``,
    ``moe_router_topk_scaling_factor``, ``moe_router_num_groups`` / ``moe_router_group_topk``,
    ``moe_router_dtype``, ``moe_router_enable_expert_bias`` / ``moe_router_bias_update_rate``,
    ``moe_router_load_balancing_type`` / ``moe_aux_loss_coeff`` (a type or a list of types with a list of
    coefficients), ``moe_z_loss_coeff``, ``moe_input_jitter_eps``, ``moe_expert_capacity_factor`` /
    ``moe_token_drop_policy`` / ``moe_pad_expert_input_to_capacity``.

    Losses. Computed only in training mode with gradients enabled (not in eval, not under ``no_grad``
    recomputation), each multiplied by its coefficient and attached to the graph through
    ``MoEAuxLossAutoScaler`` with gradient ``aux_loss_scale``: the load-balancing losses to ``probs``, the
    z-loss to the logits. A load-balancing type whose coefficient is 0 is skipped, as in Megatron. Their
    inputs are every expert's softmax score (sigmoid: normalised per token) and each token's plain top-k
    (``routing_scores_for_aux_loss``), before expert bias, group limits and dropping.

    - ``aux_loss``: Switch loss ``E * sum_e f_e * P_e`` over the T tokens of this forward.
    - ``seq_aux_loss``: the same per sequence, averaged over sequences. Sequences come from the input's
      shape: ``[B, S, H]`` is B sequences of S tokens (batch-first, as ``MoELayer`` passes it); ``[T, H]``
      is one sequence.
    - ``global_aux_loss``: ``f_e`` from the loads of every forward since ``reset_global_aux_loss_tracker()``
      (summed over ``tp_dp_group`` when given), ``P_e`` from this forward's tokens. Megatron averages the
      counts over its micro-batches (``ga_steps``) and divides ``P`` by the group's token total; here ``f``
      is the pooled fraction (equal to Megatron's for equal-sized micro-batches) and each rank's loss is a
      full Switch loss, so the trainer's ``aux_loss_scale`` averages it over ranks like the main loss.

    Tensor parallelism (``tp_group``, with sequence parallelism): each TP rank routes its own slice of the
    tokens, and each loss of a rank is its share of the loss of the whole micro-batch (the TP ranks' shares
    sum to it, so the gradients equal TP 1's): the routed counts are summed over ``tp_group`` and every mean
    is over all the TP group's tokens. ``recorder`` then holds this rank's shares. ``weight`` is a
    ``Replicate`` DTensor of the TP mesh; its gradient is reduced over the TP group once per forward, where
    the logits read it (``tp_weights.tp_full``).

    Args:
        config: ``TransformerConfig`` with ``num_moe_experts`` set.
        tp_dp_group: process group over which ``global_aux_loss`` and ``finish_step`` sum their token counts (the
            ranks that see different tokens); None counts this process's tokens only. Every rank of it must run the same
            number of training forwards.
        tp_group: the TP group whose ranks hold the other slices of this rank's sequences; None: no TP.

    Attributes:
        weight: ``[E, H]`` parameter, init normal(0, ``init_method_std``).
        expert_bias: ``[E]`` float32 buffer, added to the selection scores only (the probs keep the unbiased
            scores); saved in the state dict when ``moe_router_enable_expert_bias``. Megatron applies it to
            sigmoid scores; with softmax it is added to what top-k ranks (the logits, or the pre-softmax probs).
        local_tokens_per_expert: ``[E]`` float32 buffer, rows routed per expert (after dropping) by the
            forwards in training mode with gradients enabled since the last ``update_expert_bias()``. It counts
            this process's tokens only: ``finish_step`` sums it over ``tp_dp_group`` before the update.
        aux_loss_scale: float, the gradient each loss receives in backward (times its coefficient), read
            by each forward; the trainer sets it before the forward to the factor its main loss carries
            (e.g. 1 / (micro-batches * DP size)).
        recorder: ``moe.metrics.RoutingRecorder``, the rows per expert (after dropping) and the raw losses of the
            last forward in training mode with gradients enabled (``moe.metrics.routing_report`` reads it).
    Raises:
        ValueError: ``config.num_moe_experts`` is None.
    """

    def __init__(self, config: TransformerConfig, tp_dp_group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("config.num_moe_experts: TopKRouter needs a number of experts, got None")
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.tp_dp_group = tp_dp_group
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.router_dtype = _ROUTER_DTYPES[config.moe_router_dtype]
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, mean=0.0, std=config.init_method_std)
        types = config.moe_router_load_balancing_type
        coeffs = config.moe_aux_loss_coeff
        pairs = zip(types, coeffs, strict=True) if isinstance(types, list) else [(types, coeffs)]
        self.aux_loss_coeffs = {t: float(c) for t, c in pairs if t != "none" and c}
        zeros = torch.zeros(self.num_experts, dtype=torch.float32)
        self.register_buffer("expert_bias", zeros.clone(), persistent=config.moe_router_enable_expert_bias)
        self.register_buffer("local_tokens_per_expert", zeros.clone(), persistent=False)
        self.register_buffer("global_tokens_per_expert", zeros.clone(), persistent=False)
        self.register_buffer("global_num_tokens", torch.zeros((), dtype=torch.float32), persistent=False)
        self.aux_loss_scale = 1.0
        z_losses = ["z_loss"] if config.moe_z_loss_coeff else []
        self.recorder = RoutingRecorder(self.num_experts, [*self.aux_loss_coeffs, *z_losses])

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in _FP32_BUFFERS:
            self._buffers[name] = self._buffers[name].float()
        return self

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``hidden``.

        Args:
            hidden: ``[B, S, H]`` (B sequences of S tokens, batch-first) or ``[T, H]`` (one sequence), float.
        Returns:
            ``probs`` ``[T, E]`` float32: the weight of each selected expert, exactly 0 elsewhere (and where
            dropped); ``routing_map`` ``[T, E]`` bool: True where token t goes to expert e. T = B * S.
        Raises:
            ValueError: ``hidden`` is not ``[B, S, hidden_size]`` or ``[T, hidden_size]``.
            TypeError: ``hidden`` is not floating point.
        """
        hidden_size = self.weight.shape[1]
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != hidden_size:
            raise ValueError(
                f"hidden: expected [B, S, {hidden_size}] or [T, {hidden_size}], got {tuple(hidden.shape)}"
            )
        if not hidden.is_floating_point():
            raise TypeError(f"hidden: expected a floating dtype, got {hidden.dtype}")
        batch, seq = hidden.shape[:2] if hidden.dim() == 3 else (1, hidden.shape[0])
        with_losses = self.training and torch.is_grad_enabled()
        losses: dict[str, torch.Tensor] = {}
        logits_TE = self._logits(hidden.reshape(-1, hidden_size))
        if with_losses and self.config.moe_z_loss_coeff:
            losses["z_loss"] = z_loss(logits_TE) / self.tp_size
            logits_TE = MoEAuxLossAutoScaler.apply(
                logits_TE, losses["z_loss"] * self.config.moe_z_loss_coeff, self.aux_loss_scale
            )
        probs_TE, routing_map_TE = self._topk_routing(logits_TE)
        routed_TE = routing_map_TE
        if self.config.moe_expert_capacity_factor is not None:
            capacity = get_capacity(logits_TE.shape[0], self.num_experts, self.config.moe_expert_capacity_factor,
                                    self.topk)
            probs_TE, routing_map_TE = apply_token_dropping(
                probs_TE, routing_map_TE, capacity, self.config.moe_token_drop_policy,
                self.config.moe_pad_expert_input_to_capacity,
            )
        if with_losses and self.aux_loss_coeffs:
            balancing = self._load_balancing_losses(logits_TE, batch, seq)
            losses.update(balancing)
            total = sum(self.aux_loss_coeffs[kind] * loss for kind, loss in balancing.items())
            probs_TE = MoEAuxLossAutoScaler.apply(probs_TE, total, self.aux_loss_scale)
        if with_losses:
            with torch.no_grad():
                # Padding slots of drop_and_pad are not routed rows: count kept routed rows only.
                tokens_per_expert_E = (routed_TE & routing_map_TE).sum(dim=0).float()
                self.recorder.record(tokens_per_expert_E, losses)
                if not is_recomputing():  # a forward run again in backward counts once
                    self.local_tokens_per_expert += tokens_per_expert_E
        return probs_TE.float(), routing_map_TE

    def _logits(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` logits, computed in ``moe_router_dtype`` and returned in at least float32.

        With ``moe_router_dtype`` set, autocast is off for the logits GEMM, so under bf16 autocast they are
        the float32 (or float64) product of the float32 inputs (Megatron's router_gating_linear); with None
        the GEMM runs in the input's dtype, or the autocast dtype.
        """
        eps = self.config.moe_input_jitter_eps
        if self.training and eps:
            hidden_TH = hidden_TH * torch.empty_like(hidden_TH).uniform_(1.0 - eps, 1.0 + eps)
        weight_EH = tp_full(self.weight)
        if self.router_dtype is None:
            logits_TE = hidden_TH @ weight_EH.to(hidden_TH.dtype).t()
        else:
            logits_TE = router_gating_linear(hidden_TH, weight_EH, self.router_dtype)
        # Scores, top-k and losses never run in bf16, whatever the GEMM ran in (Megatron: fp32 scores).
        return logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))

    def _topk_routing(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs [T, E], routing_map [T, E] bool)`` before dropping (Megatron's
        ``topk_routing_with_score_function``)."""
        cfg = self.config
        if cfg.moe_router_score_function == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
        elif cfg.moe_router_pre_softmax:
            scores_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = logits_TE  # top-k on the logits, softmax over the K selected (Mixtral)
        selection_TE = scores_TE
        if cfg.moe_router_enable_expert_bias:
            selection_TE = scores_TE.detach() + self.expert_bias.to(scores_TE.dtype)
        top_idx_TK = topk_indices(selection_TE, self.topk, cfg.moe_router_num_groups, cfg.moe_router_group_topk)
        top_TK = scores_TE.gather(1, top_idx_TK)
        if cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax:
            top_TK = torch.softmax(top_TK, dim=-1)
        elif cfg.moe_router_score_function == "sigmoid" and self.topk > 1:
            top_TK = top_TK / (top_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.moe_router_topk_scaling_factor is not None:
            top_TK = top_TK * cfg.moe_router_topk_scaling_factor
        probs_TE = torch.zeros_like(scores_TE).scatter(1, top_idx_TK, top_TK)
        routing_map_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter(1, top_idx_TK, True)
        return probs_TE, routing_map_TE

    def _load_balancing_losses(self, logits_TE: torch.Tensor, batch: int, seq: int) -> dict[str, torch.Tensor]:
        """Raw load-balancing losses, one per type with a nonzero coefficient."""
        scores_TE, routing_map_TE = routing_scores_for_aux_loss(logits_TE, self.config.moe_router_score_function,
                                                                self.topk)
        num_tokens = logits_TE.shape[0]
        routing_map_BSE = routing_map_TE.view(batch, seq, self.num_experts)
        counts_BE = self._sum_over_tp(routing_map_BSE.sum(dim=1))  # the whole sequences' counts under TP
        losses: dict[str, torch.Tensor] = {}
        for kind in self.aux_loss_coeffs:
            if kind == "aux_loss":
                losses[kind] = switch_load_balancing_loss(
                    scores_TE, counts_BE.sum(dim=0), num_tokens * self.tp_size, self.topk) / self.tp_size
            elif kind == "seq_aux_loss":
                losses[kind] = sequence_load_balancing_loss(
                    scores_TE.view(batch, seq, self.num_experts), routing_map_BSE, self.topk,
                    counts_BE=counts_BE, seq_length=seq * self.tp_size,
                )
            else:
                counts_E, total = self._accumulate_global_counts(routing_map_TE.sum(dim=0), num_tokens)
                losses[kind] = switch_load_balancing_loss(scores_TE, counts_E, total, self.topk) / self.tp_size
        return losses

    @torch.no_grad()
    def _sum_over_tp(self, counts: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.tp_group)
        return counts

    @torch.no_grad()
    def _accumulate_global_counts(self, counts_E: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this forward's loads (summed over ``tp_dp_group``) to the global tracker; return its totals. A forward
        run again in backward (activation recompute) returns the totals its first run saw, adding nothing."""
        if is_recomputing():
            return self.global_tokens_per_expert.clone(), self.global_num_tokens.clone()
        stats = torch.cat([counts_E.float(), counts_E.new_tensor([num_tokens], dtype=torch.float32)])
        if self.tp_dp_group is not None:
            dist.all_reduce(stats, group=self.tp_dp_group)
        self.global_tokens_per_expert += stats[:-1]
        self.global_num_tokens += stats[-1]
        return self.global_tokens_per_expert.clone(), self.global_num_tokens.clone()

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new global batch for ``global_aux_loss``; call after each optimizer step (as Megatron does)."""
        self.global_tokens_per_expert.zero_()
        self.global_num_tokens.zero_()

    @torch.no_grad()
    def finish_step(self, skipped: bool) -> None:
        """Call after each optimizer step: the expert-bias update on the global batch's loads, then a new global
        batch for ``global_aux_loss``. ``skipped``: the step did not count (``training.step``'s non-finite steps),
        so its loads are dropped and the bias stays.

        Collective over ``tp_dp_group`` (one all-reduce) when the step counts and ``moe_router_enable_expert_bias``
        is on (the only reader of the summed loads), so every rank's bias stays equal; the flag is the same on
        every rank.
        """
        if skipped or not self.config.moe_router_enable_expert_bias:
            self.local_tokens_per_expert.zero_()
        else:
            if self.tp_dp_group is not None:
                with named_collective("all_reduce (tokens per expert)", self.tp_dp_group):
                    dist.all_reduce(self.local_tokens_per_expert, group=self.tp_dp_group)
            self.update_expert_bias()
        self.reset_global_aux_loss_tracker()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing step ``expert_bias += rate * sign(mean_e(load) - load)``; resets the counter.

        ``load`` is ``local_tokens_per_expert``, once it holds the global batch's counts (``finish_step`` sums it
        over the data-parallel group first, so the bias stays equal on all ranks). The bias moves only when
        ``moe_router_enable_expert_bias``; the counter is always reset. Source: Wang et al. 2024
        (Auxiliary-Loss-Free Load Balancing, arXiv:2408.15664), Megatron's ``get_updated_expert_bias``.
        """
        if self.config.moe_router_enable_expert_bias:
            load_E = self.local_tokens_per_expert
            self.expert_bias += self.config.moe_router_bias_update_rate * torch.sign(load_E.mean() - load_E)
        self.local_tokens_per_expert.zero_()


__all__ = ["TopKRouter", "topk_indices"]
