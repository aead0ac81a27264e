"""Token permutation for the dispatchers: routing map -> row maps -> permute (gather) / unpermute (gather-sum).

Legend: T tokens, H hidden, E experts, K slots per token (top-k), R routed rows (expert-major), C capacity
per expert.

The ideas follow Megatron-LM's ``moe_utils.py`` (``permute``, ``unpermute``): rows are ordered expert-major so
that each expert's rows are contiguous for the grouped GEMM. Unlike Megatron's scatter-add, unpermute here is a
gather-sum over each token's K rows (``moe_core.ops.permute``): deterministic, and its backward is a gather.
moe_core applies ``probs`` inside the experts (before fc2), so unpermute sums without weights. Under autocast
the permuted rows move in the autocast dtype: the cast is fused into the gather.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moe_core.ops.pack import pack_rows
from moe_core.ops.permute import permute_rows, unpermute_rows


@dataclass(frozen=True)
class RowMap:
    """Where each routed row comes from and where each token's rows are.

    Attributes:
        token_of_row: ``[R]`` int64, the token row r copies; -1 for a padding row (drop_and_pad), which holds
            zeros; -2 for an unused row past the routed ones under a row bound (``build_row_map``'s
            ``num_out_tokens`` as a bound: the sync-free dispatch's received rows), left unwritten: no kernel reads
            the rows past tokens_per_expert's sum.
        row_of_slot: ``[T, K]`` int64, the rows of token t in expert order; -1 for an empty slot (a dropped
            or unused one).
    """

    token_of_row: torch.Tensor
    row_of_slot: torch.Tensor


def build_row_map(routing_map: torch.Tensor, num_slots: int, num_out_tokens: int | None = None,
                  capacity: int | None = None) -> tuple[RowMap, torch.Tensor]:
    """The ``RowMap`` of ``routing_map`` ``[T, E]`` bool (rows expert-major, token order inside an expert) and
    ``expert_of_row`` ``[R]`` int64.

    Args:
        num_slots: K, at least the most experts any token has (``moe_router_topk``).
        num_out_tokens: R when known (``routing_map.sum()``), or a bound on it whose rows past the sum are unused
            (token -2): spares ``nonzero``'s host sync.
        capacity: C for drop_and_pad: expert e's rows are its routed tokens in token order, then padding rows,
            C rows in all (R = E * C). The router must already have dropped tokens beyond C.
    """
    num_tokens, num_experts = routing_map.shape
    device = routing_map.device
    if capacity is None:
        flat_ET = routing_map.t().reshape(-1)  # position p = e * T + t
        if num_out_tokens is None:
            positions = flat_ET.nonzero().squeeze(1)
        else:
            positions = torch.nonzero_static(flat_ET, size=num_out_tokens).squeeze(1)
        valid = positions >= 0  # nonzero_static fills the rows past the sum with -1
        token_of_row = torch.where(valid, positions.remainder(max(num_tokens, 1)), -2)
        expert_of_row = positions.div(max(num_tokens, 1), rounding_mode="floor")
    else:
        # Routed tokens sort first (stable keeps token order); columns past T are padding.
        order_ET = routing_map.t().to(torch.int8).argsort(dim=1, descending=True, stable=True)
        if capacity > num_tokens:
            order_ET = torch.cat([order_ET, order_ET.new_zeros(num_experts, capacity - num_tokens)], dim=1)
        idx_EC = order_ET[:, :capacity]
        valid_EC = routing_map.t().gather(1, idx_EC)
        valid_EC[:, num_tokens:] = False
        valid = valid_EC.reshape(-1)
        token_of_row = torch.where(valid, idx_EC.reshape(-1), -1)
        expert_of_row = torch.arange(num_experts, device=device).repeat_interleave(capacity)
    # A row's slot: how many of its token's experts come before its expert.
    slot_TE = routing_map.to(torch.int32).cumsum(dim=1) - 1
    slot_of_row = slot_TE[token_of_row.clamp_min(0), expert_of_row].long()
    # Padding rows write into a spare column K, dropped after.
    slot_of_row = torch.where(valid, slot_of_row, num_slots)
    row_of_slot = torch.full((num_tokens, num_slots + 1), -1, dtype=torch.int64, device=device)
    rows = torch.arange(token_of_row.shape[0], device=device)
    row_of_slot.index_put_((token_of_row.clamp_min(0), slot_of_row), rows)
    return RowMap(token_of_row, row_of_slot[:, :num_slots].contiguous()), expert_of_row


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None,
            num_out_tokens: int | None = None, drop_and_pad: bool = False, num_slots: int | None = None,
            pack_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, RowMap]:
    """Gather token rows into expert-major order (Megatron's ``permute`` with a routing map).

    Rows of expert 0 come first, then expert 1, ...; inside an expert, rows are in token order.

    Args:
        tokens: ``[T, H]``.
        routing_map: ``[T, E]`` bool, True where token t goes to expert e.
        probs: ``[T, E]`` float (0 where not routed) or None; gathered alongside, differentiably.
        num_out_tokens: R, the number of output rows, or None. Without ``drop_and_pad`` it must equal
            ``routing_map.sum()`` (e.g. ``T * topk`` when nothing is dropped) and spares the host sync of a
            data-dependent selection; it is checked only on the CPU outside compilation, where the check costs
            no sync. With ``drop_and_pad`` it is ``E * C`` and required.
        drop_and_pad: static shapes: expert e's rows are its routed tokens in token order, then zero padding
            rows whose prob is 0, C rows in all. The router must already have dropped tokens beyond C
            (``apply_token_dropping``); extra ones would be cut here silently.
        num_slots: K, at least the most experts any token has; None: E (always enough).
        pack_probs: write the float32 probs into the rows' tails (``moe_core.ops.pack.pack_rows`` with one value,
            ``[R, W]``) in the same pass, instead of returning them apart; needs ``probs``.
    Returns:
        ``(permuted [R, H], permuted_probs [R] in probs' dtype or None, row_map)``, or with ``pack_probs``
        ``(packed [R, W], None, row_map)``; the rows are in tokens' dtype, or the autocast dtype inside
        ``torch.autocast``. Host sync: only without ``drop_and_pad`` and without ``num_out_tokens`` (R is
        data-dependent; ``nonzero`` must size its output).
    Raises:
        ValueError / TypeError: shapes, dtypes, ``num_slots`` or ``num_out_tokens`` do not fit, or
            ``pack_probs`` without ``probs``.
    """
    _check_routing(tokens, routing_map, probs)
    if pack_probs and probs is None:
        raise ValueError("probs: pack_probs=True needs probs, got None")
    num_tokens, num_experts = routing_map.shape
    num_slots = num_experts if num_slots is None else num_slots
    check_num_slots(routing_map, num_slots)
    checkable = _checkable(routing_map)
    capacity = None
    if drop_and_pad:
        if num_out_tokens is None or num_out_tokens < 0 or num_out_tokens % num_experts:
            raise ValueError(
                f"num_out_tokens: expected E * capacity (a multiple of E={num_experts}) with drop_and_pad, "
                f"got {num_out_tokens}"
            )
        capacity = num_out_tokens // num_experts
    elif num_out_tokens is not None and checkable and int(routing_map.sum()) != num_out_tokens:
        raise ValueError(f"num_out_tokens: expected routing_map.sum() = {int(routing_map.sum())}, got {num_out_tokens}")
    row_map, expert_of_row = build_row_map(routing_map, num_slots, num_out_tokens, capacity)
    permuted_probs = None if probs is None else _row_probs(probs, row_map.token_of_row, expert_of_row)
    if pack_probs:
        packed = pack_rows(tokens, permuted_probs.float().unsqueeze(1), row_map.token_of_row.unsqueeze(1),
                           row_map.row_of_slot, compute_dtype(tokens))
        return packed, None, row_map
    permuted = permute_rows(tokens, row_map.token_of_row, row_map.row_of_slot, compute_dtype(tokens))
    return permuted, permuted_probs, row_map


def _row_probs(probs: torch.Tensor, token_of_row: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """``[R]``: each row's prob, 0 for a padding or unused row."""
    return gather_row_probs(probs, token_of_row * probs.shape[1] + expert_of_row, token_of_row >= 0)


def gather_row_probs(values: torch.Tensor, index_R: torch.Tensor, routed_R: torch.Tensor) -> torch.Tensor:
    """``[R]``: ``values.reshape(-1)[index_R[r]]`` where ``routed_R[r]``, else 0 (padding and unused rows).

    A row not routed reads a zero of its own, appended after the values: the gradient's accumulation then never
    meets one index many times (thousands of rows on one entry serialise its atomics), and whatever gradient such
    a row gets is dropped. Differentiable in ``values``.

    Args:
        values: any shape, float. index_R: ``[R]`` int64, flat positions into values (any value where not
            routed). routed_R: ``[R]`` bool.
    """
    num_rows = index_R.shape[0]
    flat = torch.cat([values.reshape(-1), values.new_zeros(num_rows)])
    own_zero = values.numel() + torch.arange(num_rows, device=index_R.device)
    return flat[torch.where(routed_R, index_R, own_zero)]


def unpermute(permuted: torch.Tensor, row_map: RowMap) -> torch.Tensor:
    """Sum each token's expert rows: ``out[t] = sum over k of permuted[row_of_slot[t, k]]``.

    The inverse of ``permute`` up to the sum over each token's experts, as a gather-sum: deterministic, no
    atomics. A pure sum: moe_core applies the probs inside the experts.

    Args:
        permuted: ``[R, H]`` expert outputs.
        row_map: from ``permute``.
    Returns:
        ``[T, H]`` in ``permuted``'s dtype, summed in float32; tokens routed nowhere get zeros.
    Raises:
        ValueError: the shapes disagree.
    """
    if permuted.dim() != 2 or row_map.token_of_row.shape != permuted.shape[:1]:
        raise ValueError(
            f"permuted / row_map.token_of_row: expected [R, H] and [R], got {tuple(permuted.shape)} and "
            f"{tuple(row_map.token_of_row.shape)}"
        )
    return unpermute_rows(permuted, row_map.token_of_row, row_map.row_of_slot)


@functools.cache
def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """A side CUDA stream of ``device`` for the MoE layer's overlapped work, one per ``purpose`` (``"dispatch"``:
    the dispatcher's index kernels; ``"shared_expert"``), so that the short work never queues behind the long."""
    return torch.cuda.Stream(device)


def check_num_slots(routing_map: torch.Tensor, num_slots: int) -> None:
    """Raise ``ValueError`` when a token of ``routing_map`` [T, E] has more than ``num_slots`` experts. Checked on
    the CPU outside compilation only, where it costs no host sync."""
    if _checkable(routing_map) and routing_map.shape[0] and int(routing_map.sum(dim=1).max()) > num_slots:
        raise ValueError(f"num_slots: a token has {int(routing_map.sum(dim=1).max())} experts, more than {num_slots}")


def _checkable(routing_map: torch.Tensor) -> bool:
    return not routing_map.is_cuda and not torch.compiler.is_compiling()


def compute_dtype(tokens: torch.Tensor) -> torch.dtype:
    """The autocast dtype for float32/16-bit tokens inside ``torch.autocast``, else tokens' own dtype."""
    device_type = tokens.device.type
    if tokens.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tokens.dtype


def _check_routing(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None) -> None:
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected [N, H], got shape {tuple(tokens.shape)}")
    if routing_map.dtype != torch.bool:
        raise TypeError(f"routing_map: expected torch.bool, got {routing_map.dtype}")
    if routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"routing_map: expected [N={tokens.shape[0]}, E], got {tuple(routing_map.shape)}")
    if probs is not None and probs.shape != routing_map.shape:
        raise ValueError(f"probs: expected {tuple(routing_map.shape)} like routing_map, got {tuple(probs.shape)}")


__all__ = ["RowMap", "build_row_map", "permute", "unpermute", "side_stream", "check_num_slots", "compute_dtype",
           "gather_row_probs"]
