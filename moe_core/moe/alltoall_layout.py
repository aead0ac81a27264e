"""Index maps of the all-to-all dispatcher's row layouts (token rows: ``alltoall_token_rows.py``; expert rows:
``alltoall_expert_rows.py``), all computed on the device without host syncs.

Legend (docs/design.md): T tokens, E experts, P EP ranks, L local experts per EP rank, K topk, M_s token rows sent,
M token rows received, R expert rows; X, Y the two axes of a grid of row chunks.
"""

from __future__ import annotations

import math

import torch

from moe_core.moe.moe_utils import RowMap, build_row_map
from moe_core.ops.triton_available import triton_available


def chunk_transpose_index(counts_XY: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The gather index that reorders rows held in chunks (x, y), x-major, into y-major chunk order.

    Megatron's ``sort_chunks_by_idxs`` for the chunk grid of an all-to-all, as one index: ``rows[index]`` lists
    chunk (0, 0), (1, 0), ..., (X-1, 0), (0, 1), ... with each chunk's rows in their order. Computed on the
    device (no host sync).

    Args:
        counts_XY: ``[X, Y]`` int64, the rows of chunk (x, y).
        num_rows: their sum (a host int, so the output's size needs no sync).
    Returns:
        ``[num_rows]`` int64 on counts' device, a permutation of ``range(num_rows)``.
    """
    num_x, num_y = counts_XY.shape
    device = counts_XY.device
    counts_xy = counts_XY.reshape(-1)
    start_xy = counts_xy.cumsum(0) - counts_xy  # where chunk (x, y) starts in the x-major source
    counts_yx = counts_XY.t().reshape(-1)
    start_yx = counts_yx.cumsum(0) - counts_yx  # where chunk (x, y) starts in the y-major output
    chunk = torch.repeat_interleave(torch.arange(num_x * num_y, device=device), counts_yx, output_size=num_rows)
    shift = start_xy.view(num_x, num_y).t().reshape(-1) - start_yx  # per y-major chunk id
    return torch.arange(num_rows, device=device) + shift[chunk]


def token_rows(dest_TP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The send rows of the token-row layout: a row per (token, destination rank) where ``dest_TP [T, P]`` is set,
    rank-major, token order inside a rank.

    Sized for the most rows there can be (``T * P``), so no host sync is needed before the count is known: the
    first M_s entries are the rows, the rest filler (token T - 1, rank -1) to slice away.

    Returns:
        ``(token_of_row [T * P], dest_of_row [T * P], row_of_slot [T, P])`` int64: the token and rank of each
        row, and the row of each (token, rank) (-1 where not sent).
    """
    num_tokens, ep = dest_TP.shape
    flat_PT = dest_TP.t().reshape(-1)  # position p * T + t
    rank_major_row = flat_PT.cumsum(0) - 1
    row_of_slot = torch.where(dest_TP, rank_major_row.view(ep, num_tokens).t(), -1)
    positions = torch.nonzero_static(flat_PT, size=num_tokens * ep).squeeze(1)  # filler -1 at the end
    tokens = max(num_tokens, 1)
    return positions.remainder(tokens), positions.div(tokens, rounding_mode="floor"), row_of_slot


def all_token_rows(num_tokens: int, ep: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_rows``' maps when every token goes to every rank (the sync-free layout): row ``p * T + t``.

    Returns:
        ``(token_of_row [P * T], dest_of_row [P * T], row_of_slot [T, P])`` int64.
    """
    rows = torch.arange(ep * num_tokens, device=device)
    return rows.remainder(max(num_tokens, 1)), rows.div(max(num_tokens, 1), rounding_mode="floor"), \
        rows.view(ep, num_tokens).t()


def row_probs(routing_map: torch.Tensor, probs: torch.Tensor, token_of_row: torch.Tensor, dest_of_row: torch.Tensor,
              ep: int) -> torch.Tensor:
    """``[M_s, L]`` float32, a tail per sent row: its token's probs for the L experts of the row's destination rank,
    -inf where the token is not routed (the receiver reads the routing from it: any other value, NaN included, is
    routed, so a NaN token stays NaN rather than silently routed nowhere). Differentiable in ``probs``.

    Args:
        routing_map: ``[T, E]`` bool. probs: ``[T, E]`` float (any value where not routed). token_of_row /
            dest_of_row: ``[M_s]`` int64, each row's token and destination rank (``token_rows``; filler rows'
            rank -1 reads the last rank, sliced away by the caller).
        ep: P, the EP size; ``E = P * L``.
    """
    num_tokens, num_experts = routing_map.shape
    tail = torch.where(routing_map, probs.float(), -math.inf).view(num_tokens, ep, num_experts // ep)
    return tail[token_of_row, dest_of_row]


def received_row_map(values_ML: torch.Tensor, num_slots: int, num_rows: int
                     ) -> tuple[RowMap, torch.Tensor, torch.Tensor]:
    """The expert rows of received token rows from their tails: ``values_ML`` [M, L] float32, -inf where a row is
    not routed to a local expert (``row_probs``).

    Args:
        num_slots: K, at least the most local experts any row has. num_rows: R, the routed entries or a bound on
            them (a host int); the rows past the routed ones are unused (token_of_row -2, value_index 0).
    Returns:
        ``(row_map, value_index [R], tokens_per_expert [L])``: ``moe_utils.build_row_map``'s map of ``values_ML !=
        -inf`` (NaN is routed; expert-major, row order inside an expert), the flat position ``m * L + e`` of each
        expert row's value (its prob: ``values_ML.take(value_index)``), and the rows per local expert; int64 on
        values' device.
        On CUDA three Triton kernels (``ops/triton/row_map.py``) build it, the same maps bit for bit; under
        torch.compile the PyTorch ops below, which Inductor fuses.
    """
    if not torch.compiler.is_compiling() and values_ML.is_cuda and triton_available():
        from moe_core.ops.triton.row_map import received_row_map as triton_row_map

        token_of_row, value_index, row_of_slot, tokens_per_expert = triton_row_map(values_ML, num_slots, num_rows)
        return RowMap(token_of_row, row_of_slot), value_index, tokens_per_expert
    routing_ML = values_ML != -math.inf
    row_map, expert_of_row = build_row_map(routing_ML, num_slots, num_out_tokens=num_rows)
    value_index = torch.where(row_map.token_of_row >= 0, row_map.token_of_row * routing_ML.shape[1] + expert_of_row, 0)
    return row_map, value_index, routing_ML.sum(dim=0)


__all__ = ["chunk_transpose_index", "token_rows", "all_token_rows", "row_probs", "received_row_map"]
