"""Differentiable collectives over the first dimension, used by the EP token dispatchers.

Each forward collective has its mirror as backward (Megatron's ``_AllToAll``, ``_GatherFromSequenceParallel
Region`` / ``_ReduceScatterToSequenceParallelRegion`` in megatron/core/tensor_parallel/mappings.py):

    all_to_all(splits_out <- splits_in)   backward: all_to_all(splits_in <- splits_out)
    all_gather_first_dim                  backward: reduce_scatter_first_dim (sum)
    reduce_scatter_first_dim (sum)        backward: all_gather_first_dim

Every function issues exactly one collective in forward and one in backward on every rank of ``group``,
including a rank whose share is empty, so ranks never disagree on the sequence of collectives. A group of
size 1 (or ``None``) makes them the identity with no collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from moe_core.parallel.collective_errors import named_collective


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 for ``None`` (single-process use)."""
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    with named_collective(f"all_to_all_single (MoE tokens, {x.shape[0]} rows out, {out.shape[0]} in)", group):
        dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad_out, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Send rows ``x[sum(input_splits[:r]) : ...]`` to rank r; receive ``output_splits[r]`` rows from rank r.

    Args:
        x: ``[sum(input_splits), ...]`` any dtype; rows grouped by destination rank.
        output_splits / input_splits: host ints, one per rank of ``group`` (zeros allowed).
    Returns:
        ``[sum(output_splits), ...]``, rows grouped by source rank. Differentiable (backward: reverse
        all-to-all).
    Raises:
        ValueError: split lengths differ from the group size or ``input_splits`` does not sum to ``x.shape[0]``.

    Under torch.compile the splits become constants of the graph (static ones only: the sync-free dispatch).
    """
    size = group_size(group)
    output_splits, input_splits = [int(s) for s in output_splits], [int(s) for s in input_splits]
    if len(output_splits) != size or len(input_splits) != size:
        raise ValueError(
            f"all_to_all: expected {size} output and input splits, got {len(output_splits)} and {len(input_splits)}"
        )
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"all_to_all: input_splits sum to {sum(input_splits)} but x has {x.shape[0]} rows")
    if size == 1:
        return x
    if torch.compiler.is_compiling():  # static splits, traced: the functional collective and its autograd
        return funcol.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    with named_collective(f"all_gather_into_tensor ({tuple(x.shape)} per rank)", group):
        dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    with named_collective(f"reduce_scatter_tensor ({tuple(x.shape)})", group):
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad_out):
        return _reduce_scatter(grad_out, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad_out):
        return _all_gather(grad_out, ctx.group), None


def all_gather_first_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[rows, ...]`` on each rank -> ``[size * rows, ...]`` in rank order; every rank must pass the same shape.

    Differentiable for floating tensors (backward: sum reduce-scatter). Bool tensors travel as uint8.
    """
    if group_size(group) == 1:
        return x
    if x.dtype == torch.bool:
        return _all_gather(x.to(torch.uint8), group).bool()
    return _AllGather.apply(x, group)


def reduce_scatter_first_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``[size * rows, ...]`` over the ranks and keep this rank's ``[rows, ...]`` block. Differentiable.

    Raises:
        ValueError: ``x.shape[0]`` is not a multiple of the group size.
    """
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"reduce_scatter_first_dim: {x.shape[0]} rows do not split over {size} ranks")
    return _ReduceScatter.apply(x, group)


__all__ = ["all_to_all", "all_gather_first_dim", "reduce_scatter_first_dim", "group_size"]
