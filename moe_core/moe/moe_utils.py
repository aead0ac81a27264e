"""Token permutation for the dispatchers (capacity helpers live in capacity.py and are re-exported here).

Legend: N tokens, H hidden, E experts, R routed rows (expert-major), C capacity per expert.

The ideas follow Megatron-LM's ``moe_utils.py`` (``permute``, ``unpermute``, ``get_capacity``,
``apply_router_token_dropping``): rows are ordered expert-major so that each expert's rows are contiguous
for the grouped GEMM. moe_core applies ``probs`` inside the experts (before fc2), so ``unpermute`` is a pure
scatter-add.
"""

from __future__ import annotations

import torch


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None,
            num_out_tokens: int | None = None, drop_and_pad: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Gather token rows into expert-major order (Megatron's ``permute`` with a routing map).

    Rows of expert 0 come first, then expert 1, ...; inside an expert, rows are in token order.

    Args:
        tokens: ``[N, H]``.
        routing_map: ``[N, E]`` bool, True where token n goes to expert e.
        probs: ``[N, E]`` float (0 where not routed) or None; gathered alongside, differentiably.
        num_out_tokens: R, the number of output rows, or None. Without ``drop_and_pad`` it must equal
            ``routing_map.sum()`` (e.g. ``N * topk`` when nothing is dropped) and spares the host sync of a
            data-dependent selection; it is checked only on the CPU, where the check costs no sync. With
            ``drop_and_pad`` it is ``E * C`` and required.
        drop_and_pad: static shapes: expert e's rows are its routed tokens in token order, then padding rows
            (unrouted tokens, or token 0 when C > N) whose prob is 0, C rows in all. The router must already
            have dropped tokens beyond C (``apply_token_dropping``); extra ones would be cut here silently.
    Returns:
        ``(permuted [R, H], permuted_probs [R] or None, sorted_indices [R] int64)`` where
        ``sorted_indices[r]`` is the token of row r. Host sync: only without ``drop_and_pad`` and without
        ``num_out_tokens`` (R is data-dependent; ``nonzero`` must size its output).
    Raises:
        ValueError / TypeError: shapes, dtypes or ``num_out_tokens`` do not fit.
    """
    _check_routing(tokens, routing_map, probs)
    num_tokens, num_experts = routing_map.shape
    map_EN = routing_map.t()
    if drop_and_pad:
        if num_out_tokens is None or num_out_tokens < 0 or num_out_tokens % num_experts:
            raise ValueError(
                f"num_out_tokens: expected E * capacity (a multiple of E={num_experts}) with drop_and_pad, "
                f"got {num_out_tokens}"
            )
        capacity = num_out_tokens // num_experts
        if capacity and not num_tokens:
            raise ValueError(f"tokens: drop_and_pad with capacity {capacity} needs at least one token, got 0")
        # Routed tokens sort first (stable keeps token order); columns past N point at token 0 as padding.
        order_EN = map_EN.to(torch.int8).argsort(dim=1, descending=True, stable=True)
        if capacity > num_tokens:
            order_EN = torch.cat([order_EN, order_EN.new_zeros(num_experts, capacity - num_tokens)], dim=1)
        idx_EC = order_EN[:, :capacity]
        valid_EC = map_EN.gather(1, idx_EC)
        valid_EC[:, num_tokens:] = False
        sorted_indices = idx_EC.reshape(-1)
        permuted_probs = None if probs is None else (probs.t().gather(1, idx_EC) * valid_EC).reshape(-1)
    else:
        flat = map_EN.reshape(-1)  # position p = e * N + n
        if num_out_tokens is None:
            positions = flat.nonzero().squeeze(1)
        else:
            if not flat.is_cuda and int(flat.sum()) != num_out_tokens:
                raise ValueError(
                    f"num_out_tokens: expected routing_map.sum() = {int(flat.sum())}, got {num_out_tokens}"
                )
            positions = torch.nonzero_static(flat, size=num_out_tokens).squeeze(1)
        sorted_indices = positions.remainder(max(num_tokens, 1))
        permuted_probs = None if probs is None else probs.t().reshape(-1).index_select(0, positions)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size | tuple[int, int]
              ) -> torch.Tensor:
    """Scatter-add expert-major rows back to their tokens: ``out[sorted_indices[r]] += permuted[r]``.

    The inverse of ``permute`` up to the sum over each token's experts. A pure sum: moe_core applies the
    probs inside the experts, and padding rows of drop_and_pad arrive as exact zeros.

    Args:
        permuted: ``[R, H]`` expert outputs.
        sorted_indices: ``[R]`` int64 from ``permute``.
        restore_shape: ``(N, H)``.
    Returns:
        ``[N, H]`` in ``permuted``'s dtype; tokens routed nowhere get zeros.
    Raises:
        ValueError: the shapes disagree.
    """
    if permuted.dim() != 2 or sorted_indices.shape != permuted.shape[:1]:
        raise ValueError(
            f"permuted / sorted_indices: expected [R, H] and [R], got {tuple(permuted.shape)} and "
            f"{tuple(sorted_indices.shape)}"
        )
    if len(restore_shape) != 2 or restore_shape[1] != permuted.shape[1]:
        raise ValueError(f"restore_shape: expected (N, {permuted.shape[1]}), got {tuple(restore_shape)}")
    return permuted.new_zeros(restore_shape).index_add(0, sorted_indices, permuted)


def _check_routing(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None) -> None:
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected [N, H], got shape {tuple(tokens.shape)}")
    if routing_map.dtype != torch.bool:
        raise TypeError(f"routing_map: expected torch.bool, got {routing_map.dtype}")
    if routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"routing_map: expected [N={tokens.shape[0]}, E], got {tuple(routing_map.shape)}")
    if probs is not None and probs.shape != routing_map.shape:
        raise ValueError(f"probs: expected {tuple(routing_map.shape)} like routing_map, got {tuple(probs.shape)}")


__all__ = ["permute", "unpermute"]
