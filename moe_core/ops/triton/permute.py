"""Row gather kernels of permute/unpermute: no atomics, so both directions are deterministic.

Legend: T tokens, K slots per token (top-k), R routed rows, H hidden.
"""

import torch
import triton
import triton.language as tl

_BLOCK_H = 1024


@triton.jit
def _gather_rows_kernel(src_ptr, index_ptr, dst_ptr, H, BLOCK_H: tl.constexpr):
    # dst[r] = src[index[r]], or zeros where index[r] < 0; one program per (row, column block).
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    src_row = tl.load(index_ptr + row).to(tl.int64)
    mask = cols < H
    values = tl.load(src_ptr + src_row * H + cols, mask=mask & (src_row >= 0), other=0.0)
    tl.store(dst_ptr + row.to(tl.int64) * H + cols, values.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_rows_kernel(src_ptr, index_ptr, dst_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    # dst[t] = sum over k of src[index[t, k]] in float32, skipping index < 0, in the fixed order k = 0..K-1.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(K):
        src_row = tl.load(index_ptr + token * K + k).to(tl.int64)
        acc += tl.load(src_ptr + src_row * H + cols, mask=mask & (src_row >= 0), other=0.0).to(tl.float32)
    tl.store(dst_ptr + token * H + cols, acc.to(dst_ptr.dtype.element_ty), mask=mask)


def _block(h: int) -> int:
    return min(_BLOCK_H, triton.next_power_of_2(max(h, 16)))


def gather_rows(src: torch.Tensor, index: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``[R, H]`` in ``out_dtype``: row r is ``src[index[r]]`` (``src`` ``[T, H]`` contiguous), zeros where
    ``index[r] < 0``."""
    rows, h = index.shape[0], src.shape[1]
    out = torch.empty(rows, h, dtype=out_dtype, device=src.device)
    if rows and h:
        block = _block(h)
        _gather_rows_kernel[(rows, triton.cdiv(h, block))](src, index, out, h, BLOCK_H=block, num_warps=4)
    return out


def gather_sum_rows(src: torch.Tensor, index: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]`` in ``out_dtype``: row t is the float32 sum of ``src[index[t, k]]`` over the K slots with
    ``index >= 0`` (``src`` ``[R, H]`` contiguous, ``index`` ``[T, K]`` contiguous)."""
    tokens, k = index.shape
    h = src.shape[1]
    out = torch.empty(tokens, h, dtype=out_dtype, device=src.device)
    if tokens and h:
        block = _block(h)
        _gather_sum_rows_kernel[(tokens, triton.cdiv(h, block))](src, index, out, h, K=k, BLOCK_H=block,
                                                                   num_warps=4)
    return out
