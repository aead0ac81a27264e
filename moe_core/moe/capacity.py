"""Expert capacity and token dropping (Megatron-LM's ``get_capacity`` and ``apply_router_token_dropping``).

Legend (docs/design.md): T tokens, E experts, K = moe_router_topk, C capacity (rows an expert may take).

With ``moe_expert_capacity_factor`` set, each expert keeps at most C of the tokens routed to it and the rest
are dropped (their prob becomes 0 and their routing_map entry False): GShard / Switch Transformer's capacity.
"""

from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, topk: int = 1,
                 min_capacity: int | None = None) -> int:
    """Rows each expert may take: ``ceil(num_tokens * topk / num_experts * capacity_factor)``.

    Megatron's ``get_capacity`` called as the router calls it (``num_tokens=tokens * topk``), with the
    product in the same order so the rounding matches. ``topk=1`` gives Megatron's own signature.

    Args:
        num_tokens: tokens T (or routed rows T * K with the default ``topk=1``), >= 0.
        num_experts: E, > 0.
        capacity_factor: > 0; 1.0 is exactly the balanced share.
        topk: experts per token K, > 0.
        min_capacity: lower bound on the result, if given.
    Returns:
        C, a python int.
    Raises:
        ValueError: an argument is out of range.
    """
    if num_tokens < 0 or num_experts < 1 or topk < 1:
        raise ValueError(
            f"get_capacity: expected num_tokens >= 0, num_experts >= 1, topk >= 1, got {num_tokens}, "
            f"{num_experts}, {topk}"
        )
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor: expected > 0, got {capacity_factor}")
    capacity = math.ceil(num_tokens * topk / num_experts * capacity_factor)
    return capacity if min_capacity is None else max(capacity, min_capacity)


def apply_token_dropping(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                         drop_policy: str = "probs", pad_to_capacity: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity`` tokens per expert (Megatron's ``apply_router_token_dropping``).

    Args:
        probs: ``[T, E]`` float, 0 where not routed. Differentiable: kept entries pass their gradient.
        routing_map: ``[T, E]`` bool, True where token t is routed to expert e.
        capacity: C >= 0, rows kept per expert.
        drop_policy: ``"probs"`` keeps each expert's C highest-prob tokens (ties in any order),
            ``"position"`` its C earliest tokens (lowest t).
        pad_to_capacity: return a map with exactly ``min(C, T)`` entries per expert (drop_and_pad, for
            static shapes): the kept routed tokens, then unrouted tokens as padding. Padding entries have
            prob 0, so they add nothing to the output.
    Returns:
        ``(probs [T, E], routing_map [T, E] bool)``: dropped entries are exactly 0 / False.
    Raises:
        ValueError: unknown ``drop_policy``, negative ``capacity`` or mismatched shapes.
        TypeError: ``routing_map`` is not bool.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy: expected one of {DROP_POLICIES}, got {drop_policy!r}")
    if routing_map.dtype != torch.bool:
        raise TypeError(f"routing_map: expected torch.bool, got {routing_map.dtype}")
    if routing_map.dim() != 2 or probs.shape != routing_map.shape:
        raise ValueError(
            f"probs / routing_map: expected the same [T, E] shape, got {tuple(probs.shape)} and "
            f"{tuple(routing_map.shape)}"
        )
    if capacity < 0:
        raise ValueError(f"capacity: expected >= 0, got {capacity}")
    num_tokens = routing_map.shape[0]
    # Rank every (token, expert) entry so that routed entries beat unrouted ones; topk over tokens then
    # keeps the best C routed tokens, and with padding fills the remaining slots with unrouted tokens.
    if drop_policy == "probs":
        score_TE = torch.where(routing_map, probs.detach().float(), -1.0)
    else:
        position_T1 = torch.arange(num_tokens, device=probs.device, dtype=torch.float32)[:, None]
        score_TE = torch.where(routing_map, -position_T1, -2.0 * num_tokens - 1.0)
    kept_idx_CE = score_TE.topk(min(capacity, num_tokens), dim=0).indices
    capacity_mask_TE = torch.zeros_like(routing_map).scatter_(0, kept_idx_CE, True)
    kept_TE = routing_map & capacity_mask_TE
    return probs * kept_TE, (capacity_mask_TE if pad_to_capacity else kept_TE)


__all__ = ["DROP_POLICIES", "get_capacity", "apply_token_dropping"]
