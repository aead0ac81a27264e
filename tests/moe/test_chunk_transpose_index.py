"""chunk_transpose_index: the alltoall dispatcher's sort by local expert as one gather index, against the
split-and-concatenate of Megatron's sort_chunks_by_idxs written out here."""

import pytest
import torch

from moe_core.moe.token_dispatcher_alltoall import chunk_transpose_index


def split_and_cat(rows: torch.Tensor, counts_AB: torch.Tensor) -> torch.Tensor:
    num_a, num_b = counts_AB.shape
    chunks = torch.split(rows, counts_AB.reshape(-1).tolist())
    return torch.cat([chunks[a * num_b + b] for b in range(num_b) for a in range(num_a)])


@pytest.mark.parametrize("num_a,num_b", [(1, 1), (2, 4), (4, 2), (3, 5)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_equals_split_and_cat_and_its_transpose_inverts_it(num_a, num_b, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (num_a, num_b), generator=g)
    counts[0, 0] = 0  # empty chunks anywhere
    num_rows = int(counts.sum())
    rows = torch.randn(num_rows, 3, generator=g)
    sort = chunk_transpose_index(counts, num_rows)
    assert torch.equal(rows[sort], split_and_cat(rows, counts))
    unsort = chunk_transpose_index(counts.t(), num_rows)
    assert torch.equal(sort[unsort], torch.arange(num_rows)) and torch.equal(unsort[sort], torch.arange(num_rows))


def test_all_empty():
    assert chunk_transpose_index(torch.zeros(2, 3, dtype=torch.int64), 0).shape == (0,)
