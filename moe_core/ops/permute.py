"""Permute and unpermute as row copies: ``torch.ops.moe_core.permute_rows`` / ``unpermute_rows``.

Legend: T tokens, K slots per token (top-k), R routed rows, H hidden.

Two index maps describe a routing (built by ``moe_core.moe.moe_utils.build_row_map``): ``token_of_row [R]``,
the token each routed row copies (-1: a padding row of zeros; -2: an unused row, left unwritten on CUDA and zeros
elsewhere), and ``row_of_slot [T, K]``, the row holding
each of a token's K slots (-1: an empty slot). Permute writes ``x[token_of_row]``; unpermute gathers each
token's K rows and sums them in slot order. Each is the other's backward. Permute's rows are copies, one writer
each, so on CUDA it scatters every token row to its slots (reading the source once) and zeros the padding rows;
unpermute gathers, with no atomics: results are deterministic. On CUDA these are Triton kernels
(``ops/triton/permute.py``); elsewhere the PyTorch references of ``ops/reference.py``. ``ops/pack.py`` has the
same gathers into and out of rows that carry extra float32 values.
"""

from __future__ import annotations

import torch

from moe_core.ops.eager import EagerOp
from moe_core.ops.reference import gather_rows_ref, gather_sum_rows_ref
from moe_core.ops.triton_available import triton_available


def scatter_rows_into(src: torch.Tensor, slot_index: torch.Tensor, row_index: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """Write ``src[row_index[r]]`` (zeros where ``row_index[r] == -1``; where it is -2, zeros or nothing) into row r
    of ``out``, cast to out's dtype; returns ``out``. ``slot_index`` [T, K] int64 is the inverse map: for each row t
    of ``src``, the rows of ``out`` that copy it (-1: none), every row of ``out`` either listed once, by a slot of its
    ``row_index[r]``, or padding. On CUDA each source row is read once and written to its rows. ``src`` [T, H] and
    ``out`` [R, H] may be column slices of wider rows; ``row_index`` [R] int64."""
    if src.is_cuda and triton_available():
        from moe_core.ops.triton.permute import scatter_rows_into as triton_scatter

        return triton_scatter(src if src.stride(1) == 1 else src.contiguous(), slot_index.contiguous(),
                              row_index.contiguous(), out)
    return out.copy_(gather_rows_ref(src, row_index, out.dtype))


def gather_sum_rows_into(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the sum of ``src[index[t, k]]`` over the slots with ``index >= 0``, in slot order, in float32 (float64
    for float64 sources), into row t of ``out``, cast to out's dtype; returns ``out``. ``src`` [R, H] and ``out``
    [T, H] as in ``scatter_rows_into``; ``index`` [T, K] int64."""
    if src.is_cuda and triton_available():
        from moe_core.ops.triton.permute import gather_sum_rows_into as triton_gather_sum

        return triton_gather_sum(src if src.stride(1) == 1 else src.contiguous(), index.contiguous(), out)
    return out.copy_(gather_sum_rows_ref(src, index, out.dtype))


def _permute_rows(x: torch.Tensor, token_of_row: torch.Tensor, row_of_slot: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    out = x.new_empty(token_of_row.shape[0], x.shape[1], dtype=out_dtype)
    return scatter_rows_into(x, row_of_slot, token_of_row, out)


def _unpermute_rows(y: torch.Tensor, token_of_row: torch.Tensor, row_of_slot: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    out = y.new_empty(row_of_slot.shape[0], y.shape[1], dtype=out_dtype)
    return gather_sum_rows_into(y, row_of_slot, out)


def _save_maps(ctx, inputs, output):
    src, token_of_row, row_of_slot, _ = inputs
    ctx.save_for_backward(token_of_row, row_of_slot)
    ctx.src_dtype = src.dtype


def _permute_rows_backward(ctx, grad):
    token_of_row, row_of_slot = ctx.saved_tensors
    return _UNPERMUTE_ROWS(grad, token_of_row, row_of_slot, ctx.src_dtype), None, None, None


def _unpermute_rows_backward(ctx, grad):
    token_of_row, row_of_slot = ctx.saved_tensors
    return _PERMUTE_ROWS(grad, token_of_row, row_of_slot, ctx.src_dtype), None, None, None


# triton_op: the implementation is also the fake kernel, and compilation traces into it (ops/triton/__init__.py).
_permute_op = torch.library.triton_op("moe_core::permute_rows", _permute_rows, mutates_args=())
_unpermute_op = torch.library.triton_op("moe_core::unpermute_rows", _unpermute_rows, mutates_args=())
_permute_op.register_autograd(_permute_rows_backward, setup_context=_save_maps)
_unpermute_op.register_autograd(_unpermute_rows_backward, setup_context=_save_maps)
_PERMUTE_ROWS = EagerOp(torch.ops.moe_core.permute_rows, _permute_rows, _save_maps, _permute_rows_backward)
_UNPERMUTE_ROWS = EagerOp(torch.ops.moe_core.unpermute_rows, _unpermute_rows, _save_maps, _unpermute_rows_backward)


def permute_rows(x_TH: torch.Tensor, token_of_row_R: torch.Tensor, row_of_slot_TK: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[R, H]``: row r is ``x_TH[token_of_row_R[r]]`` cast to ``out_dtype`` (default x's), zeros where the index
    is -1, and where it is -2 (an unused row) zeros or, on CUDA, nothing. Differentiable in x; its backward is
    ``unpermute_rows`` of the gradient.

    Args:
        x_TH: ``[T, H]`` float. token_of_row_R: ``[R]`` int64. row_of_slot_TK: ``[T, K]`` int64, the
        inverse map: every row r with ``token_of_row_R[r] = t >= 0`` in exactly one slot of row t, no other
        row listed (``moe_utils.build_row_map``'s maps). The forward on CUDA and both backwards rely on it.
    """
    return _PERMUTE_ROWS(x_TH, token_of_row_R, row_of_slot_TK, out_dtype or x_TH.dtype)


def unpermute_rows(y_RH: torch.Tensor, token_of_row_R: torch.Tensor, row_of_slot_TK: torch.Tensor,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[T, H]``: row t sums ``y_RH[row_of_slot_TK[t, k]]`` over its non-empty slots in slot order, in float32
    (float64 for float64 rows), cast to ``out_dtype`` (default y's). Differentiable in y; its backward is
    ``permute_rows`` of the gradient (padding rows, index -1, get zero gradient; unused rows, -2, none)."""
    return _UNPERMUTE_ROWS(y_RH, token_of_row_R, row_of_slot_TK, out_dtype or y_RH.dtype)


__all__ = ["permute_rows", "unpermute_rows", "scatter_rows_into", "gather_sum_rows_into"]
