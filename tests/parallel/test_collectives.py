"""Differentiable collectives: uneven and empty splits, and backward equal to the mirror collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_core.parallel.collectives import all_gather_first_dim, all_to_all, reduce_scatter_first_dim
from tests.parallel._launch import device, run_distributed


def _splits(world: int, pattern: str) -> torch.Tensor:
    """sends[s, d]: rows rank s sends to rank d."""
    g = torch.Generator().manual_seed(7)
    sends = torch.randint(0, 4, (world, world), generator=g)
    if pattern == "rank1_sends_nothing":
        sends[1] = 0
    elif pattern == "rank0_receives_nothing":
        sends[:, 0] = 0
    elif pattern == "all_empty":
        sends.zero_()
    return sends


def _all_to_all(pattern: str) -> None:
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    sends = _splits(world, pattern)
    # Row i sent from s to d carries the value 1000 * s + 100 * d + i: the receiver can check every row.
    rows = [1000 * rank + 100 * d + i for d in range(world) for i in range(int(sends[rank, d]))]
    x = torch.tensor(rows, dtype=torch.float64, device=dev).reshape(-1, 1).repeat(1, 3).requires_grad_()
    y = all_to_all(x, sends[:, rank].tolist(), sends[rank].tolist(), dist.group.WORLD)
    expected = [1000 * s + 100 * rank + i for s in range(world) for i in range(int(sends[s, rank]))]
    assert y.shape == (len(expected), 3)
    assert torch.equal(y[:, 0].cpu(), torch.tensor(expected, dtype=torch.float64))
    # d(sum(y * w)) / dx must route w back to the sender: the weight is the receiver's rank + 1.
    (y * (rank + 1)).sum().backward()
    dest = [d for d in range(world) for _ in range(int(sends[rank, d]))]
    assert torch.equal(x.grad[:, 0].cpu(), torch.tensor(dest, dtype=torch.float64) + 1)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pattern", ["random", "rank1_sends_nothing", "rank0_receives_nothing", "all_empty"])
def test_all_to_all_uneven_and_empty(world, pattern):
    run_distributed(world, _all_to_all, pattern=pattern)


def _gather_scatter() -> None:
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    x = torch.full((2, 3), float(rank), dtype=torch.float64, device=dev, requires_grad=True)
    g = all_gather_first_dim(x, dist.group.WORLD)
    assert torch.equal(g[:, 0].cpu(), torch.arange(world, dtype=torch.float64).repeat_interleave(2))
    weight = torch.arange(2 * world, dtype=torch.float64, device=dev)[:, None]
    (g * weight * (rank + 1)).sum().backward()
    # Sum over ranks r of (r + 1) * weight of this rank's rows.
    scale = world * (world + 1) / 2
    assert torch.equal(x.grad.cpu(), (weight[2 * rank:2 * rank + 2] * scale).expand(2, 3).cpu())

    z = torch.ones(2 * world, 3, dtype=torch.float64, device=dev, requires_grad=True)
    s = reduce_scatter_first_dim(z * (rank + 1), dist.group.WORLD)
    assert torch.equal(s.cpu(), torch.full((2, 3), scale, dtype=torch.float64))
    (s * (rank + 1)).sum().backward()
    # Block b of z feeds rank b's output, weighted (rank + 1) here and (b + 1) there.
    block_weight = (torch.arange(world, dtype=torch.float64) + 1).repeat_interleave(2)[:, None]
    assert torch.equal(z.grad.cpu(), ((rank + 1) * block_weight).expand(2 * world, 3))
    mask = all_gather_first_dim(torch.tensor([rank == 0, True], device=dev), dist.group.WORLD)
    assert mask.dtype == torch.bool and mask.tolist() == [True, True] + [False, True] * (world - 1)


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_reduce_scatter_are_mirrors(world):
    run_distributed(world, _gather_scatter)


def test_bad_splits_raise_without_a_group():
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="input_splits sum to 2 but x has 3 rows"):
        all_to_all(x, [2], [2], None)
    with pytest.raises(ValueError, match="expected 1 output and input splits, got 2 and 1"):
        all_to_all(x, [1, 2], [3], None)
    assert all_to_all(x, [3], [3], None) is x
