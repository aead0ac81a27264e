"""The expert-major row map of received token rows in three launches (``moe_core.moe.alltoall_layout.
received_row_map``), in place of a few dozen index ops: the all-to-all dispatcher builds it after its host sync,
where every host call delays the experts.

Legend: N received token rows, L local experts, K slots per row (top-k), R expert rows, B row blocks.

A row n is routed to local expert e where ``values[n, e] != -inf`` (NaN is routed: a NaN token must stay NaN). Rows are
expert-major, row order inside an expert (``moe_core.moe.moe_utils.build_row_map``'s order): the row of (n, e) is the
rows of experts before e, plus those of e in row blocks before n's, plus those of e before n in its block.
"""

import torch
import triton
import triton.language as tl

_TILE = 8192  # elements of a [rows, experts] tile


@triton.jit
def _routed_tile(values_ptr, stride, block, N, L, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    # (rows [BLOCK_N], cols [BLOCK_L], routed [BLOCK_N, BLOCK_L] int32) of row block `block`; 0 outside [N, L].
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_L)
    mask = (rows[:, None] < N) & (cols[None, :] < L)
    values = tl.load(values_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=-float("inf"))
    return rows, cols, (values != -float("inf")).to(tl.int32)


@triton.jit
def _block_counts_kernel(values_ptr, stride, counts_ptr, N, L, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    # counts[b, e]: rows of block b routed to expert e.
    block = tl.program_id(0)
    rows, cols, routed = _routed_tile(values_ptr, stride, block, N, L, BLOCK_N, BLOCK_L)
    tl.store(counts_ptr + block * L + cols, tl.sum(routed, axis=0), mask=cols < L)


@triton.jit
def _block_starts_kernel(counts_ptr, starts_ptr, tokens_per_expert_ptr, B, L, BLOCK_L: tl.constexpr):
    # One program: starts[b, e] = the expert-major row of block b's first row of expert e; tokens_per_expert[e].
    cols = tl.arange(0, BLOCK_L)
    mask = cols < L
    total = tl.zeros((BLOCK_L,), dtype=tl.int64)
    for block in range(B):
        total += tl.load(counts_ptr + block * L + cols, mask=mask, other=0)
    tl.store(tokens_per_expert_ptr + cols, total, mask=mask)
    running = tl.cumsum(total, axis=0) - total
    for block in range(B):
        tl.store(starts_ptr + block * L + cols, running, mask=mask)
        running += tl.load(counts_ptr + block * L + cols, mask=mask, other=0)


@triton.jit
def _row_map_kernel(values_ptr, stride, starts_ptr, token_of_row_ptr, value_index_ptr, row_of_slot_ptr, N, L,
                    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    rows, cols, routed = _routed_tile(values_ptr, stride, block, N, L, BLOCK_N, BLOCK_L)
    start = tl.load(starts_ptr + block * L + cols, mask=cols < L, other=0)
    row = start[None, :] + (tl.cumsum(routed, axis=0) - routed)  # int64: the expert-major row of (n, e)
    slot = tl.cumsum(routed, axis=1) - routed  # how many of row n's experts come before e
    is_routed = routed != 0
    tl.store(token_of_row_ptr + row, tl.broadcast_to(rows[:, None].to(tl.int64), row.shape), mask=is_routed)
    tl.store(value_index_ptr + row, rows[:, None].to(tl.int64) * L + cols[None, :], mask=is_routed)
    tl.store(row_of_slot_ptr + rows[:, None].to(tl.int64) * K + slot, row, mask=is_routed & (slot < K))
    # The slots past each row's experts: -1.
    used = tl.sum(routed, axis=1)
    ks = tl.arange(0, BLOCK_K)
    empty = (rows[:, None] < N) & (ks[None, :] >= used[:, None]) & (ks[None, :] < K)
    tl.store(row_of_slot_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], tl.full((BLOCK_N, BLOCK_K), -1, tl.int64),
             mask=empty)


def received_row_map(values: torch.Tensor, num_slots: int, num_rows: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_of_row [R], value_index [R], row_of_slot [N, K], tokens_per_expert [L])``, int64, of the rows routed
    in ``values`` [N, L] float32 (any row stride, contiguous columns; -inf where not routed). ``value_index[r] =
    n * L + e``. ``num_rows``: R, their count or a bound on it (a host int; the rows past the count are unused
    rows: token -2, value index 0); ``num_slots``: K, at least any row's experts."""
    n, num_local = values.shape
    device = values.device
    block_l = triton.next_power_of_2(max(num_local, 1))
    block_n = max(16, _TILE // block_l)
    blocks = triton.cdiv(n, block_n)
    token_of_row = torch.full((num_rows,), -2, dtype=torch.int64, device=device)
    value_index = torch.zeros(num_rows, dtype=torch.int64, device=device)
    row_of_slot = torch.empty(n, num_slots, dtype=torch.int64, device=device)
    tokens_per_expert = torch.empty(num_local, dtype=torch.int64, device=device)
    if n == 0 or num_local == 0:
        return token_of_row, value_index, row_of_slot.fill_(-1), tokens_per_expert.zero_()
    counts = torch.empty(blocks, num_local, dtype=torch.int64, device=device)
    starts = torch.empty_like(counts)
    _block_counts_kernel[(blocks,)](values, values.stride(0), counts, n, num_local, BLOCK_N=block_n,
                                    BLOCK_L=block_l, num_warps=4)
    _block_starts_kernel[(1,)](counts, starts, tokens_per_expert, blocks, num_local, BLOCK_L=block_l, num_warps=1)
    _row_map_kernel[(blocks,)](values, values.stride(0), starts, token_of_row, value_index, row_of_slot, n,
                               num_local, K=num_slots, BLOCK_N=block_n, BLOCK_L=block_l,
                               BLOCK_K=triton.next_power_of_2(max(num_slots, 1)), num_warps=8)
    return token_of_row, value_index, row_of_slot, tokens_per_expert
