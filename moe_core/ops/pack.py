"""Packed rows: a row's H values and a few float32 values (its prob, its local experts) in one row, so that one
all-to-all moves both: ``torch.ops.moe_core.pack_rows`` / ``unpack_rows``.

Legend: H hidden, V float32 values per row, W packed width; M and N the rows on the two sides of a gather; Ki and
Kb the slots of a gather index and of its inverse.

Layout (``packed_width``): ``W = roundup(H, 16) + roundup(4 V bytes in columns, 16)``: the H values, zero padding
to a multiple of 16 columns, then the tail: V float32 values as bits, zero padding. Multiples of 16 columns keep
packed rows as aligned as plain ones (Triton's wide loads).

Both ops gather rows through an index table ``[rows, K]``: row i is the float32 sum of the source rows
``index[i, k] >= 0`` in slot order (one slot: a copy, zeros for -1). ``pack_rows`` gathers plain rows into packed
ones, writing the values into the tails; ``unpack_rows`` gathers the H values out of packed rows and returns the
tails. Each is the other's backward with the index and its ``inverse`` swapped (``inverse`` lists for every
source row the output rows that read it). A one-slot index is a copy, which ``ops/permute.py``'s
``scatter_rows_into`` does from the inverse, reading each source row once (Triton on CUDA); sums gather. No
atomics: deterministic. In backward a tail carries the values' gradient: bits in transit, not a differentiable
number.
"""

from __future__ import annotations

import torch

from moe_core.ops.eager import EagerOp
from moe_core.ops.permute import gather_sum_rows_into, scatter_rows_into

_ALIGN = 16  # columns


def _roundup(columns: int) -> int:
    return -(-columns // _ALIGN) * _ALIGN


def packed_width(hidden_size: int, num_values: int, dtype: torch.dtype) -> int:
    """W, the columns of a packed row of ``dtype`` holding ``hidden_size`` values and ``num_values`` float32s."""
    return _roundup(hidden_size) + _roundup(-(-4 * num_values // dtype.itemsize))


def packed_values(packed: torch.Tensor, hidden_size: int, num_values: int) -> torch.Tensor:
    """The ``[rows, V]`` float32 view of packed rows' values (a view, outside autograd: ``unpack_rows`` returns
    them differentiably)."""
    return packed.detach()[:, _roundup(hidden_size):].view(torch.float32)[:, :num_values]


def _tail(packed: torch.Tensor, hidden_size: int, num_values: int) -> torch.Tensor:
    return packed[:, _roundup(hidden_size):].view(torch.float32)[:, :num_values]


def _rows_into(src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    if index.shape[1] == 1:
        scatter_rows_into(src, inverse, index[:, 0], out)
    else:
        gather_sum_rows_into(src, index, out)


def _pack_rows(x: torch.Tensor, values: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    hidden_size, num_values = x.shape[1], values.shape[1]
    packed = x.new_empty(index.shape[0], packed_width(hidden_size, num_values, out_dtype), dtype=out_dtype)
    _rows_into(x, index, inverse, packed[:, :hidden_size])
    packed[:, hidden_size:].zero_()
    _tail(packed, hidden_size, num_values).copy_(values)
    return packed


def _unpack_rows(packed: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, hidden_size: int,
                 num_values: int, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out = packed.new_empty(index.shape[0], hidden_size, dtype=out_dtype)
    _rows_into(packed[:, :hidden_size], index, inverse, out)
    return out, _tail(packed, hidden_size, num_values).clone()


_pack_op = torch.library.custom_op("moe_core::pack_rows", _pack_rows, mutates_args=())
_unpack_op = torch.library.custom_op("moe_core::unpack_rows", _unpack_rows, mutates_args=())


@_pack_op.register_fake
def _(x, values, index, inverse, out_dtype):
    return x.new_empty(index.shape[0], packed_width(x.shape[1], values.shape[1], out_dtype), dtype=out_dtype)


@_unpack_op.register_fake
def _(packed, index, inverse, hidden_size, num_values, out_dtype):
    return (packed.new_empty(index.shape[0], hidden_size, dtype=out_dtype),
            packed.new_empty(packed.shape[0], num_values, dtype=torch.float32))


def _setup_pack(ctx, inputs, output):
    x, values, index, inverse, _ = inputs
    ctx.save_for_backward(index, inverse)
    ctx.x_dtype, ctx.hidden_size, ctx.num_values = x.dtype, x.shape[1], values.shape[1]


def _pack_rows_backward(ctx, grad):
    index, inverse = ctx.saved_tensors
    grad_x, grad_values = _UNPACK_ROWS(grad, inverse, index, ctx.hidden_size, ctx.num_values, ctx.x_dtype)
    return grad_x, grad_values, None, None, None


def _setup_unpack(ctx, inputs, output):
    packed, index, inverse, hidden_size, num_values, _ = inputs
    ctx.save_for_backward(index, inverse)
    ctx.packed_dtype, ctx.hidden_size, ctx.num_values = packed.dtype, hidden_size, num_values
    ctx.num_packed = packed.shape[0]


def _unpack_rows_backward(ctx, grad_out, grad_values):
    index, inverse = ctx.saved_tensors
    # An output the loss does not use may come as None: its gradient is zero.
    if grad_out is None:
        grad_out = torch.zeros(index.shape[0], ctx.hidden_size, device=index.device)
    if grad_values is None:
        grad_values = torch.zeros(ctx.num_packed, ctx.num_values, device=index.device)
    grad = _PACK_ROWS(grad_out, grad_values.float(), inverse, index, ctx.packed_dtype)
    return grad, None, None, None, None, None


_pack_op.register_autograd(_pack_rows_backward, setup_context=_setup_pack)
_unpack_op.register_autograd(_unpack_rows_backward, setup_context=_setup_unpack)
_PACK_ROWS = EagerOp(torch.ops.moe_core.pack_rows, _pack_rows, _setup_pack, _pack_rows_backward)
_UNPACK_ROWS = EagerOp(torch.ops.moe_core.unpack_rows, _unpack_rows, _setup_unpack, _unpack_rows_backward)


def pack_rows(x_NH: torch.Tensor, values_MV: torch.Tensor, index_MK: torch.Tensor, inverse_NK: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Packed rows ``[M, W]`` (``W = packed_width(H, V, out_dtype)``) in ``out_dtype`` (default x's): row m holds
    the float32 sum of ``x_NH[index_MK[m, k]]`` over its slots with index >= 0 (one slot: the row itself), cast
    once, and ``values_MV[m]`` in its tail.

    Differentiable in x and values; the backward is ``unpack_rows`` of the packed gradient by ``inverse_NK``.

    Args:
        x_NH: ``[N, H]`` float. values_MV: ``[M, V]`` float32. index_MK: ``[M, Ki]`` int64. inverse_NK: ``[N, Kb]``
            int64, for every row of x the output rows that read it (-1: none).
    Raises:
        TypeError / ValueError: values_MV is not float32 ``[M, V]``, or an index is not 2-D.
    """
    if values_MV.dtype != torch.float32 or values_MV.dim() != 2 or values_MV.shape[0] != index_MK.shape[0]:
        raise TypeError(f"values_MV: expected float32 [{index_MK.shape[0]}, V], got {values_MV.dtype} "
                        f"{tuple(values_MV.shape)}")
    _check_indices(index_MK, inverse_NK, x_NH.shape[0])
    return _PACK_ROWS(x_NH, values_MV, index_MK, inverse_NK, out_dtype or x_NH.dtype)


def unpack_rows(packed_MW: torch.Tensor, index_NK: torch.Tensor, inverse_MK: torch.Tensor, hidden_size: int,
                num_values: int, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, H], [M, V] float32)``: row n the float32 sum of the H values of ``packed_MW[index_NK[n, k]]`` over its
    slots with index >= 0, cast once to ``out_dtype`` (default packed's); and every packed row's values, in order.

    Differentiable in ``packed_MW``; the backward is ``pack_rows`` of the two gradients by ``inverse_MK``.

    Args:
        packed_MW: ``[M, packed_width(hidden_size, num_values, dtype)]``. index_NK: ``[N, Ki]`` int64.
            inverse_MK: ``[M, Kb]`` int64. hidden_size: H. num_values: V.
    Raises:
        ValueError: packed_MW's width does not fit H and V, or an index is not 2-D.
    """
    width = packed_width(hidden_size, num_values, packed_MW.dtype)
    if packed_MW.dim() != 2 or packed_MW.shape[1] != width:
        raise ValueError(f"packed_MW: expected [M, {width}] for hidden_size {hidden_size} and {num_values} values, "
                         f"got {tuple(packed_MW.shape)}")
    _check_indices(index_NK, inverse_MK, packed_MW.shape[0])
    return _UNPACK_ROWS(packed_MW, index_NK, inverse_MK, hidden_size, num_values, out_dtype or packed_MW.dtype)


def _check_indices(index: torch.Tensor, inverse: torch.Tensor, num_sources: int) -> None:
    if index.dim() != 2 or inverse.dim() != 2 or inverse.shape[0] != num_sources:
        raise ValueError(f"index / inverse: expected [rows, K] and [{num_sources}, K], got {tuple(index.shape)} and "
                         f"{tuple(inverse.shape)}")


__all__ = ["pack_rows", "unpack_rows", "packed_width", "packed_values"]
