"""Load-balancing losses for the router and the autograd scaler that feeds them into backward.

Sources: Switch Transformer (Fedus et al., 2021) for the load-balancing loss, ST-MoE (Zoph et al., 2022)
for the z-loss, and Megatron-LM's ``switch_load_balancing_loss_func``, ``z_loss_func`` and
``MoEAuxLossAutoScaler`` for their normalisation and wiring.
"""

from __future__ import annotations

import torch


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int | torch.Tensor,
                               topk: int, coeff: float) -> torch.Tensor:
    """``coeff * E / (topk * T_total * T) * sum_e(sum_t scores[t, e] * tokens_per_expert[e])``.

    With ``T_total == T`` this is Switch's ``coeff * E * sum_e f_e * P_e``, where ``f_e`` is the fraction of
    routed rows that go to e and ``P_e`` the mean score of e; it is ``coeff`` at perfect balance.

    Args:
        scores: ``[T, E]`` float, every expert's routing score per token (softmax, or sigmoid normalised
            per token), not masked to the top-k.
        tokens_per_expert: ``[E]`` rows routed to each expert, counted over ``total_num_tokens`` tokens.
        total_num_tokens: tokens behind ``tokens_per_expert`` (more than T for the global loss).
        topk: experts per token.
        coeff: the loss coefficient.
    Returns:
        A scalar float32 tensor.
    """
    num_tokens, num_experts = scores.shape
    weighted = (scores.float().sum(dim=0) * tokens_per_expert.float()).sum()
    return weighted * (num_experts * coeff / (topk * num_tokens * total_num_tokens))


def sequence_load_balancing_loss(scores_BSE: torch.Tensor, routing_map_BSE: torch.Tensor, topk: int,
                                 coeff: float) -> torch.Tensor:
    """The Switch loss computed per sequence, averaged over the B sequences (DeepSeek-V2/V3's sequence-wise loss).

    Args:
        scores_BSE: ``[B, S, E]`` routing scores; routing_map_BSE: ``[B, S, E]`` bool.
    """
    batch, seq, num_experts = scores_BSE.shape
    counts_BE = routing_map_BSE.sum(dim=1).float()
    weighted = (scores_BSE.float().sum(dim=1) * counts_BE).sum()
    return weighted * (num_experts * coeff / (topk * seq * seq * batch))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss: ``coeff * mean_t(logsumexp(logits[t])^2)``; logits ``[T, E]``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach ``aux_loss`` to ``activation`` so backward through ``activation`` also backpropagates it.

    Forward returns ``activation`` unchanged; backward passes its gradient through and gives ``aux_loss`` the
    gradient ``scale`` (Megatron's MoEAuxLossAutoScaler). ``scale`` is the factor the main loss's gradient
    carries (e.g. 1 / number of micro-batches), passed explicitly rather than held in a global.
    """

    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return activation

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


__all__ = ["switch_load_balancing_loss", "sequence_load_balancing_loss", "z_loss", "MoEAuxLossAutoScaler"]
