"""Router losses (load balancing, z-loss) and the autograd scaler that feeds them into backward.

Legend (docs/design.md): T tokens, B sequences, S tokens per sequence, E experts, K = moe_router_topk.

Every loss here is raw, without its coefficient: the router multiplies by ``moe_aux_loss_coeff`` /
``moe_z_loss_coeff`` in the graph and logs the raw value (Megatron logs ``aux_loss / coeff`` too), so a
balanced router logs a load-balancing loss of 1 whatever the coefficient.

Sources: Switch Transformer (Fedus et al., 2021, eq. 4) for the load-balancing loss, DeepSeek-V2 (2024,
sec. 2.2.3) for its per-sequence form, Qiu et al. 2025 ("Demons in the Detail", arXiv:2501.11873) for the
global-batch form, ST-MoE (Zoph et al., 2022, eq. 5) for the z-loss, and Megatron-LM's
``switch_load_balancing_loss_func``, ``compute_routing_scores_for_aux_loss``, ``z_loss_func`` and
``MoEAuxLossAutoScaler`` (megatron/core/transformer/moe/moe_utils.py) for the normalisation and wiring.
"""

from __future__ import annotations

import torch


def routing_scores_for_aux_loss(logits_TE: torch.Tensor, score_function: str, topk: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's score per token and each token's plain top-k, as the balancing losses see them.

    Softmax scores, or sigmoid scores normalised to sum to 1 per token (Megatron's
    ``compute_routing_scores_for_aux_loss``). The top-k ignores expert bias, group limits and dropping: the
    loss measures the router's own preference.

    Args:
        logits_TE: ``[T, E]`` router logits (float32 or float64).
        score_function: ``"softmax"`` or ``"sigmoid"``.
        topk: K.
    Returns:
        ``(scores [T, E]`` in ``logits_TE``'s dtype, differentiable, ``routing_map [T, E]`` bool``)``.
    Raises:
        ValueError: unknown ``score_function``.
    """
    if score_function == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    elif score_function == "sigmoid":
        sig_TE = torch.sigmoid(logits_TE)
        scores_TE = sig_TE / (sig_TE.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function: expected 'softmax' or 'sigmoid', got {score_function!r}")
    top_idx_TK = scores_TE.detach().topk(topk, dim=-1).indices
    routing_map_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter(1, top_idx_TK, True)
    return scores_TE, routing_map_TE


def switch_load_balancing_loss(scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                               total_num_tokens: int | float | torch.Tensor, topk: int) -> torch.Tensor:
    """Switch loss ``E * sum_e f_e * P_e`` with ``f_e = tokens_per_expert[e] / (K * total_num_tokens)``, the
    fraction of routed rows that expert e receives, and ``P_e = mean_t scores[t, e]`` over these T tokens.

    ``tokens_per_expert`` may count more tokens than the T behind ``scores`` (the global-batch loss):
    ``total_num_tokens`` is the number of tokens it counts. The loss is 1 at perfect balance (f_e = P_e =
    1/E) and E/K at worst (every token on the same K experts); its gradient reaches the scores only.

    Args:
        scores_TE: ``[T, E]`` float, every expert's score per token (see ``routing_scores_for_aux_loss``).
        tokens_per_expert_E: ``[E]`` routed rows per expert, over ``total_num_tokens`` tokens.
        total_num_tokens: tokens behind ``tokens_per_expert_E`` (int or 0-dim tensor; 0 only with zero counts).
        topk: K.
    Returns:
        A scalar in ``scores_TE``'s dtype; 0 when there are no tokens.
    """
    num_tokens, num_experts = scores_TE.shape
    mean_scores_E = scores_TE.sum(dim=0) / max(num_tokens, 1)
    total = torch.as_tensor(total_num_tokens, dtype=scores_TE.dtype, device=scores_TE.device).clamp_min(1)
    fraction_E = tokens_per_expert_E.to(scores_TE.dtype) / (topk * total)
    return num_experts * (fraction_E * mean_scores_E).sum()


def sequence_load_balancing_loss(scores_BSE: torch.Tensor, routing_map_BSE: torch.Tensor, topk: int, *,
                                 counts_BE: torch.Tensor | None = None, seq_length: int | None = None
                                 ) -> torch.Tensor:
    """The Switch loss of each sequence on its own, averaged over the B sequences (DeepSeek-V2's
    sequence-wise balance loss; Megatron's ``seq_aux_loss``).

    Args:
        scores_BSE: ``[B, S, E]`` float scores; routing_map_BSE: ``[B, S, E]`` bool.
        topk: K.
        counts_BE / seq_length: when the sequences are split (sequence parallelism), the routed rows per
            sequence and expert and the length of the whole sequences; the loss is then this part's share
            (the parts' losses sum to the whole sequences' loss). None: from ``routing_map_BSE``.
    Returns:
        A scalar in ``scores_BSE``'s dtype.
    """
    batch, seq, num_experts = scores_BSE.shape
    seq = seq if seq_length is None else seq_length
    if counts_BE is None:
        counts_BE = routing_map_BSE.sum(dim=1)
    counts_BE = counts_BE.to(scores_BSE.dtype)
    weighted = (scores_BSE.sum(dim=1) * counts_BE).sum()
    return weighted * (num_experts / (topk * max(seq, 1) ** 2 * max(batch, 1)))


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss ``mean_t logsumexp_e(logits[t, e])^2``; 0 when T == 0.

    Args:
        logits_TE: ``[T, E]`` float logits.
    Returns:
        A scalar in ``logits_TE``'s dtype.
    """
    return torch.logsumexp(logits_TE, dim=-1).square().sum() / max(logits_TE.shape[0], 1)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach ``aux_loss`` to ``activation``: backward through ``activation`` also backpropagates the loss.

    ``MoEAuxLossAutoScaler.apply(activation, aux_loss, scale)`` returns ``activation`` unchanged; in backward
    the activation's gradient passes through and ``aux_loss`` receives the gradient ``scale``, as if
    ``scale * aux_loss`` had been added to the loss (Megatron's MoEAuxLossAutoScaler). ``scale`` is the factor
    the main loss's gradient carries (e.g. 1 / number of micro-batches), passed explicitly instead of
    Megatron's class-level ``main_loss_backward_scale``. The aux loss's backward runs only when the
    activation's gradient is needed, i.e. when the activation reaches the loss.

    Args (of ``apply``):
        activation: any tensor on the loss's path (the router's probs or logits).
        aux_loss: a scalar tensor.
        scale: float or 0-dim tensor, read when ``apply`` runs (set it before the forward).
    """

    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * ctx.scale, None


__all__ = [
    "routing_scores_for_aux_loss",
    "switch_load_balancing_loss",
    "sequence_load_balancing_loss",
    "z_loss",
    "MoEAuxLossAutoScaler",
]
