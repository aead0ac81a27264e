"""Row kernels of permute/unpermute: no atomics, so both directions are deterministic.

Legend: T tokens, K slots per token (top-k), R routed rows, H hidden (the columns copied).

Source and destination rows may be wider than H (a packed buffer whose extra columns carry each row's prob,
``moe_core.ops.permute``): each side has its own row stride and its columns are contiguous. Triton
specialises strides that are multiples of 16, which keeps wide vector loads for 16-aligned packed widths.
"""

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from moe_core.ops.triton import plain

_BLOCK_H = 1024
# A scatter_rows program copies 2048 elements: a column block of at most 512 from each of several rows, which
# keeps more loads in flight than one wide row.
_SCATTER_BLOCK_H = 512
_SCATTER_ELEMENTS = 2048
# Rows a scatter_rows program checks for padding.
_ZERO_ROWS = 16


@triton.jit
def _scatter_rows_kernel(src_ptr, slot_ptr, token_ptr, dst_ptr, T, R, H, src_stride, dst_stride, scatter_programs,
                         K: tl.constexpr, COL_BLOCKS: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                         ZERO_ROWS: tl.constexpr):
    # Programs below scatter_programs: dst[slot[t, k]] = src[t] for the slots >= 0, each source row read once
    # (a gather walks the source once per expert). The others: zeros into the padding rows (token -1), which
    # no slot lists; unused rows (token -2) stay as they are.
    pid = tl.program_id(0)
    if pid < scatter_programs:
        tokens = (pid // COL_BLOCKS) * ROWS + tl.arange(0, ROWS)
        cols = (pid % COL_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        token_mask = tokens < T
        col_mask = cols < H
        t64 = tokens.to(tl.int64)
        values = tl.load(src_ptr + t64[:, None] * src_stride + cols[None, :],
                         mask=token_mask[:, None] & col_mask[None, :], other=0.0).to(dst_ptr.dtype.element_ty)
        for k in tl.static_range(K):
            rows = tl.load(slot_ptr + t64 * K + k, mask=token_mask, other=-1).to(tl.int64)
            tl.store(dst_ptr + rows[:, None] * dst_stride + cols[None, :], values,
                     mask=(rows >= 0)[:, None] & col_mask[None, :])
    else:
        pad_rows = (pid - scatter_programs) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        padding = tl.load(token_ptr + pad_rows, mask=pad_rows < R, other=0) == -1
        zeros = tl.zeros((ZERO_ROWS, BLOCK_H), dtype=dst_ptr.dtype.element_ty)
        for start in range(0, H, BLOCK_H):
            pad_cols = start + tl.arange(0, BLOCK_H)
            tl.store(dst_ptr + pad_rows.to(tl.int64)[:, None] * dst_stride + pad_cols[None, :], zeros,
                     mask=padding[:, None] & (pad_cols < H)[None, :])


@triton.jit
def _gather_sum_rows_kernel(src_ptr, index_ptr, dst_ptr, H, src_stride, dst_stride, K: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    # dst[t] = sum over k of src[index[t, k]] in float32, skipping index < 0, in the fixed order k = 0..K-1.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(K):
        src_row = tl.load(index_ptr + token * K + k).to(tl.int64)
        acc += tl.load(src_ptr + src_row * src_stride + cols, mask=mask & (src_row >= 0), other=0.0).to(tl.float32)
    tl.store(dst_ptr + token * dst_stride + cols, acc.to(dst_ptr.dtype.element_ty), mask=mask)


def _block(h: int) -> int:
    return min(_BLOCK_H, triton.next_power_of_2(max(h, 16)))


def _check_rows(src: torch.Tensor, out: torch.Tensor) -> None:
    if src.dim() != 2 or out.dim() != 2 or src.shape[1] != out.shape[1] or src.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"src / out: expected [*, H] rows with contiguous columns, got {tuple(src.shape)} "
                         f"(strides {src.stride()}) and {tuple(out.shape)} (strides {out.stride()})")


def scatter_rows_into(src: torch.Tensor, slot_index: torch.Tensor, row_index: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """Write ``src[t]`` into the rows ``slot_index[t, k] >= 0`` of ``out`` [R, H] and zeros into the rows with
    ``row_index[r] == -1`` (padding; -2, an unused row, is left as it is), cast to out's dtype: ``out[r] =
    src[row_index[r]]`` for inverse maps (every row of out padding or listed by exactly one slot, of its token
    ``row_index[r]``), reading each source row once.

    ``src`` [T, H] and ``out`` [R, H] may be column slices of wider buffers (any row stride, contiguous columns);
    ``slot_index`` [T, K] and ``row_index`` [R] int64 contiguous. Returns ``out``."""
    _check_rows(src, out)
    tokens, k = slot_index.shape
    rows, h = row_index.shape[0], out.shape[1]
    if rows and h:
        block = min(_SCATTER_BLOCK_H, _block(h))
        per_program, col_blocks = _SCATTER_ELEMENTS // block, triton.cdiv(h, block)
        scatter_programs = triton.cdiv(tokens, per_program) * col_blocks
        kernel = _scatter_rows_kernel if plain(src, out) else wrap_triton(_scatter_rows_kernel)
        kernel[(scatter_programs + triton.cdiv(rows, _ZERO_ROWS),)](
            src, slot_index, row_index, out, tokens, rows, h, src.stride(0), out.stride(0), scatter_programs, K=k,
            COL_BLOCKS=col_blocks, ROWS=per_program, BLOCK_H=block, ZERO_ROWS=_ZERO_ROWS, num_warps=4)
    return out


def gather_sum_rows_into(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the float32 sum of ``src[index[t, k]]`` over the K slots with ``index >= 0`` into row t of ``out``
    [T, H], cast to out's dtype. ``src`` [R, H] and ``out`` as in ``scatter_rows_into``; ``index`` [T, K] int64
    contiguous. Returns ``out``."""
    _check_rows(src, out)
    tokens, k = index.shape
    h = out.shape[1]
    if tokens and h:
        block = _block(h)
        kernel = _gather_sum_rows_kernel if plain(src, out) else wrap_triton(_gather_sum_rows_kernel)
        kernel[(tokens, triton.cdiv(h, block))](src, index, out, h, src.stride(0), out.stride(0), K=k, BLOCK_H=block,
                                                num_warps=4)
    return out
