"""Permute and unpermute as row gathers: ``torch.ops.moe_core.permute_rows`` / ``unpermute_rows``, and their
packed twins that carry each row's prob inside the row.

Legend: T tokens, K slots per token (top-k), R routed rows, H hidden, W packed width.

Two index maps describe a routing (built by ``moe_core.moe.moe_utils.build_row_map``): ``token_of_row [R]``,
the token each routed row copies (-1: a padding row of zeros), and ``row_of_slot [T, K]``, the row holding
each of a token's K slots (-1: an empty slot). Permute gathers ``x[token_of_row]``; unpermute gathers each
token's K rows and sums them in slot order. Each is the other's backward, so neither direction scatters or
uses atomics: results are deterministic. On CUDA the gathers are Triton kernels (``ops/triton/permute.py``);
elsewhere the PyTorch references of ``ops/reference.py``.

Packed rows (``permute_rows_packed`` / ``unpermute_rows_packed``): a row of ``W = roundup(H, 16) + 16``
columns holds the H values, zero padding up to a multiple of 16 columns, then a 16-column tail whose first
four bytes are the row's float32 prob, the rest zero. One all-to-all then moves rows and probs together, and
a 16-column multiple keeps the rows as aligned as the unpacked ones. In backward the tail carries the probs'
gradient the same way: the tail is a transport of bits, not a differentiable number.
"""

from __future__ import annotations

import torch

from moe_core.ops.reference import gather_rows_ref, gather_sum_rows_ref
from moe_core.ops.triton_available import triton_available

_ALIGN = 16  # columns: the packed width and the tail's start are multiples of it


def _gather_rows_into(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if src.is_cuda and triton_available():
        from moe_core.ops.triton.permute import gather_rows_into

        return gather_rows_into(src if src.stride(1) == 1 else src.contiguous(), index.contiguous(), out)
    return out.copy_(gather_rows_ref(src, index, out.dtype))


def _gather_sum_rows_into(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if src.is_cuda and triton_available():
        from moe_core.ops.triton.permute import gather_sum_rows_into

        return gather_sum_rows_into(src if src.stride(1) == 1 else src.contiguous(), index.contiguous(), out)
    return out.copy_(gather_sum_rows_ref(src, index, out.dtype))


def packed_width(hidden_size: int) -> int:
    """W, the columns of a packed row of ``hidden_size`` values: ``roundup(H, 16) + 16``."""
    return _tail_start(hidden_size) + _ALIGN


def _tail_start(hidden_size: int) -> int:
    return -(-hidden_size // _ALIGN) * _ALIGN


def _tail_probs(packed: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The float32 probs column of packed rows ``[R, W]``: a strided view into the tail."""
    return packed[:, _tail_start(hidden_size):].view(torch.float32)[:, 0]


@torch.library.custom_op("moe_core::permute_rows", mutates_args=())
def _permute_rows(x: torch.Tensor, token_of_row: torch.Tensor, row_of_slot: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    out = x.new_empty(token_of_row.shape[0], x.shape[1], dtype=out_dtype)
    return _gather_rows_into(x, token_of_row, out)


@torch.library.custom_op("moe_core::unpermute_rows", mutates_args=())
def _unpermute_rows(y: torch.Tensor, token_of_row: torch.Tensor, row_of_slot: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    out = y.new_empty(row_of_slot.shape[0], y.shape[1], dtype=out_dtype)
    return _gather_sum_rows_into(y, row_of_slot, out)


@torch.library.custom_op("moe_core::permute_rows_packed", mutates_args=())
def _permute_rows_packed(x: torch.Tensor, probs: torch.Tensor, token_of_row: torch.Tensor,
                         row_of_slot: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    hidden_size = x.shape[1]
    packed = x.new_empty(token_of_row.shape[0], packed_width(hidden_size), dtype=out_dtype)
    _gather_rows_into(x, token_of_row, packed[:, :hidden_size])
    packed[:, hidden_size:].zero_()
    _tail_probs(packed, hidden_size).copy_(probs)
    return packed


@torch.library.custom_op("moe_core::unpermute_rows_packed", mutates_args=())
def _unpermute_rows_packed(packed: torch.Tensor, token_of_row: torch.Tensor, row_of_slot: torch.Tensor,
                           hidden_size: int, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out = packed.new_empty(row_of_slot.shape[0], hidden_size, dtype=out_dtype)
    _gather_sum_rows_into(packed[:, :hidden_size], row_of_slot, out)
    return out, _tail_probs(packed, hidden_size).clone()


@_permute_rows.register_fake
def _(x, token_of_row, row_of_slot, out_dtype):
    return x.new_empty(token_of_row.shape[0], x.shape[1], dtype=out_dtype)


@_unpermute_rows.register_fake
def _(y, token_of_row, row_of_slot, out_dtype):
    return y.new_empty(row_of_slot.shape[0], y.shape[1], dtype=out_dtype)


@_permute_rows_packed.register_fake
def _(x, probs, token_of_row, row_of_slot, out_dtype):
    return x.new_empty(token_of_row.shape[0], packed_width(x.shape[1]), dtype=out_dtype)


@_unpermute_rows_packed.register_fake
def _(packed, token_of_row, row_of_slot, hidden_size, out_dtype):
    return (packed.new_empty(row_of_slot.shape[0], hidden_size, dtype=out_dtype),
            packed.new_empty(token_of_row.shape[0], dtype=torch.float32))


def _save_maps(ctx, inputs, output):
    src, token_of_row, row_of_slot, _ = inputs
    ctx.save_for_backward(token_of_row, row_of_slot)
    ctx.src_dtype = src.dtype


def _permute_rows_backward(ctx, grad):
    token_of_row, row_of_slot = ctx.saved_tensors
    return torch.ops.moe_core.unpermute_rows(grad, token_of_row, row_of_slot, ctx.src_dtype), None, None, None


def _unpermute_rows_backward(ctx, grad):
    token_of_row, row_of_slot = ctx.saved_tensors
    return torch.ops.moe_core.permute_rows(grad, token_of_row, row_of_slot, ctx.src_dtype), None, None, None


def _save_packed_maps(ctx, inputs, output):
    src, token_of_row, row_of_slot = inputs[0], inputs[-3], inputs[-2]
    ctx.save_for_backward(token_of_row, row_of_slot)
    ctx.src_dtype = src.dtype
    ctx.hidden_size = src.shape[1]


def _permute_rows_packed_backward(ctx, grad):
    token_of_row, row_of_slot = ctx.saved_tensors
    grad_x, grad_probs = torch.ops.moe_core.unpermute_rows_packed(grad, token_of_row, row_of_slot, ctx.hidden_size,
                                                                  ctx.src_dtype)
    return grad_x, grad_probs, None, None, None


def _save_unpacked_maps(ctx, inputs, output):
    packed, token_of_row, row_of_slot, hidden_size, _ = inputs
    ctx.save_for_backward(token_of_row, row_of_slot)
    ctx.src_dtype = packed.dtype
    ctx.hidden_size = hidden_size


def _unpermute_rows_packed_backward(ctx, grad_y, grad_probs):
    token_of_row, row_of_slot = ctx.saved_tensors
    # An output the loss does not use may come as None: its gradient is zero.
    if grad_y is None:
        grad_y = grad_probs.new_zeros(row_of_slot.shape[0], ctx.hidden_size)
    if grad_probs is None:
        grad_probs = grad_y.new_zeros(token_of_row.shape[0], dtype=torch.float32)
    grad = torch.ops.moe_core.permute_rows_packed(grad_y, grad_probs.float(), token_of_row, row_of_slot,
                                                  ctx.src_dtype)
    return grad, None, None, None, None


_permute_rows.register_autograd(_permute_rows_backward, setup_context=_save_maps)
_unpermute_rows.register_autograd(_unpermute_rows_backward, setup_context=_save_maps)
_permute_rows_packed.register_autograd(_permute_rows_packed_backward, setup_context=_save_packed_maps)
_unpermute_rows_packed.register_autograd(_unpermute_rows_packed_backward, setup_context=_save_unpacked_maps)


def permute_rows(x_TH: torch.Tensor, token_of_row_R: torch.Tensor, row_of_slot_TK: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[R, H]``: row r is ``x_TH[token_of_row_R[r]]`` cast to ``out_dtype`` (default x's), zeros where the
    index is -1. Differentiable in x; its backward is ``unpermute_rows`` of the gradient.

    Args:
        x_TH: ``[T, H]`` float. token_of_row_R: ``[R]`` int64. row_of_slot_TK: ``[T, K]`` int64, the
        inverse map (used by the backward).
    """
    return torch.ops.moe_core.permute_rows(x_TH, token_of_row_R, row_of_slot_TK, out_dtype or x_TH.dtype)


def unpermute_rows(y_RH: torch.Tensor, token_of_row_R: torch.Tensor, row_of_slot_TK: torch.Tensor,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[T, H]``: row t sums ``y_RH[row_of_slot_TK[t, k]]`` over its non-empty slots in slot order, in float32
    (float64 for float64 rows), cast to ``out_dtype`` (default y's). Differentiable in y; its backward is
    ``permute_rows`` of the gradient (padding rows, index -1, get zero gradient)."""
    return torch.ops.moe_core.unpermute_rows(y_RH, token_of_row_R, row_of_slot_TK, out_dtype or y_RH.dtype)


def permute_rows_packed(x_TH: torch.Tensor, probs_R: torch.Tensor, token_of_row_R: torch.Tensor,
                        row_of_slot_TK: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``permute_rows`` with each row's prob packed in: ``[R, W]`` (``W = packed_width(H)``) in ``out_dtype``
    (default x's), row r holding ``x_TH[token_of_row_R[r]]`` (zeros for index -1) and ``probs_R[r]`` in its
    tail (module docstring). One pass over the rows, the same gather as ``permute_rows``.

    Differentiable in x and probs; the backward is ``unpermute_rows_packed`` of the packed gradient.

    Args:
        x_TH: ``[T, H]`` float. probs_R: ``[R]`` float32, one per output row. token_of_row_R: ``[R]`` int64.
        row_of_slot_TK: ``[T, K]`` int64 (used by the backward).
    Raises:
        TypeError: probs_R is not float32.
    """
    if probs_R.dtype != torch.float32 or probs_R.shape != token_of_row_R.shape:
        raise TypeError(f"probs_R: expected float32 [{token_of_row_R.shape[0]}], got {probs_R.dtype} "
                        f"{tuple(probs_R.shape)}")
    return torch.ops.moe_core.permute_rows_packed(x_TH, probs_R, token_of_row_R, row_of_slot_TK,
                                                  out_dtype or x_TH.dtype)


def unpermute_rows_packed(packed_RW: torch.Tensor, token_of_row_R: torch.Tensor, row_of_slot_TK: torch.Tensor,
                          hidden_size: int, out_dtype: torch.dtype | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``unpermute_rows`` of packed rows: ``([T, H], [R] float32)``, the first the float32 sum of each token's
    rows' H values (``out_dtype``, default packed's), the second every row's packed prob, in row order.

    Differentiable in ``packed_RW``; the backward is ``permute_rows_packed`` of the two gradients.

    Args:
        packed_RW: ``[R, W]`` with ``W = packed_width(hidden_size)``. token_of_row_R: ``[R]`` int64 (used by
        the backward). row_of_slot_TK: ``[T, K]`` int64. hidden_size: H.
    Raises:
        ValueError: packed_RW is not ``[R, packed_width(hidden_size)]``.
    """
    if packed_RW.dim() != 2 or packed_RW.shape != (token_of_row_R.shape[0], packed_width(hidden_size)):
        raise ValueError(f"packed_RW: expected [{token_of_row_R.shape[0]}, {packed_width(hidden_size)}] for "
                         f"hidden_size {hidden_size}, got {tuple(packed_RW.shape)}")
    return torch.ops.moe_core.unpermute_rows_packed(packed_RW, token_of_row_R, row_of_slot_TK, hidden_size,
                                                    out_dtype or packed_RW.dtype)


__all__ = ["permute_rows", "unpermute_rows", "permute_rows_packed", "unpermute_rows_packed", "packed_width"]
