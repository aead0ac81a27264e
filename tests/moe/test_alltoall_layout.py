"""The alltoall dispatcher's index maps: chunk_transpose_index against the split-and-concatenate of Megatron's
sort_chunks_by_idxs written out here; token_rows against build_row_map; row_probs against loops;
received_row_map against build_row_map (and its Triton kernels, on a GPU, bit for bit against the reference)."""

import math

import pytest
import torch

from moe_core.moe.alltoall_layout import all_token_rows, chunk_transpose_index, received_row_map, row_probs, token_rows
from moe_core.moe.moe_utils import build_row_map


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


@pytest.mark.parametrize("num_tokens,ep", [(0, 2), (1, 2), (13, 2), (9, 4)])
def test_token_rows_lead_with_build_row_maps_rows(num_tokens, ep):
    dest = torch.rand(num_tokens, ep, generator=torch.Generator().manual_seed(num_tokens)) > 0.4
    token_of_row, dest_of_row, row_of_slot = token_rows(dest)
    assert token_of_row.shape == dest_of_row.shape == (num_tokens * ep,)
    num_sent = int(dest.sum())
    expected, expected_dest = build_row_map(dest, ep, num_out_tokens=num_sent)
    assert torch.equal(token_of_row[:num_sent], expected.token_of_row)
    assert torch.equal(dest_of_row[:num_sent], expected_dest)
    assert torch.equal(row_of_slot, torch.where(dest, row_of_slot, -1))
    for t in range(num_tokens):  # row_of_slot names each (token, rank)'s row, by rank
        for r in range(ep):
            if dest[t, r]:
                row = int(row_of_slot[t, r])
                assert (int(token_of_row[row]), int(dest_of_row[row])) == (t, r)


def test_row_probs_against_loops():
    g = torch.Generator().manual_seed(3)
    num_tokens, num_experts, ep = 7, 8, 2
    num_local = num_experts // ep
    routing = torch.rand(num_tokens, num_experts, generator=g) < 0.4
    probs = torch.rand(num_tokens, num_experts, generator=g) * routing
    probs[0, 1] = 0.0
    routing[0, 1] = True  # a routed expert whose prob is exactly 0 stays routed
    token_of_row = torch.tensor([0, 3, 6, 2])
    dest_of_row = torch.tensor([0, 1, 1, 0])
    values = row_probs(routing, probs, token_of_row, dest_of_row, ep)
    for row, (t, r) in enumerate(zip(token_of_row.tolist(), dest_of_row.tolist(), strict=True)):
        experts = range(r * num_local, (r + 1) * num_local)
        assert values[row].tolist() == [probs[t, e].item() if routing[t, e] else -math.inf for e in experts]
    assert values[0, 1].item() == 0.0


def received_tails(num_rows: int, num_local: int, num_slots: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """``[N, L]`` float32 tails inside a wider packed-like buffer (a row stride past L): each row routed to up to
    ``num_slots`` random experts with random finite values (negative and zero ones included), -inf elsewhere."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(num_rows, num_local, generator=g).argsort(dim=1)[:, :num_slots]
    keep = torch.rand(num_rows, num_slots, generator=g) < 0.8  # some rows use fewer slots, some none
    routed = torch.zeros(num_rows, num_local, dtype=torch.bool).scatter_(1, picks, keep)
    values = torch.where(routed, torch.randn(num_rows, num_local, generator=g), -math.inf)
    values[routed & (torch.rand(num_rows, num_local, generator=g) < 0.1)] = 0.0
    buffer = torch.full((num_rows, num_local + 5), float("nan"), device=device)
    buffer[:, :num_local] = values.to(device)
    return buffer[:, :num_local]


@pytest.mark.parametrize("num_rows,num_local,num_slots", [(9, 4, 2), (300, 8, 8), (0, 4, 2)])
def test_received_row_map_against_build_row_map(num_rows, num_local, num_slots):
    values = received_tails(num_rows, num_local, num_slots, seed=num_rows)
    routing = values > -math.inf
    row_map, value_index, counts = received_row_map(values, num_slots, int(routing.sum()))
    expected, expert_of_row = build_row_map(routing, num_slots)
    assert torch.equal(row_map.token_of_row, expected.token_of_row)
    assert torch.equal(row_map.row_of_slot, expected.row_of_slot)
    assert torch.equal(values.take(value_index), values[expected.token_of_row, expert_of_row])
    assert torch.equal(counts, routing.sum(dim=0))


def test_received_row_map_with_a_row_bound_pads_the_tail():
    # A bound past the routed count (the sync-free dispatch): the same map, then unused rows with token -2 and
    # value index 0; on CUDA the kernels give the same, bit for bit.
    values = received_tails(300, 8, 8, seed=3)
    num_routed = int((values > -math.inf).sum())
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        exact_map, exact_index, exact_counts = received_row_map(values.to(dev), 8, num_routed)
        row_map, value_index, counts = received_row_map(values.to(dev), 8, num_routed + 50)
        assert torch.equal(row_map.token_of_row[:num_routed], exact_map.token_of_row)
        assert row_map.token_of_row[num_routed:].tolist() == [-2] * 50
        assert torch.equal(value_index[:num_routed], exact_index) and value_index[num_routed:].tolist() == [0] * 50
        assert torch.equal(row_map.row_of_slot, exact_map.row_of_slot) and torch.equal(counts, exact_counts)


@pytest.mark.parametrize("num_tokens,ep", [(0, 2), (5, 2), (3, 4)])
def test_all_token_rows_send_every_token_to_every_rank(num_tokens, ep):
    token_of_row, dest_of_row, row_of_slot = all_token_rows(num_tokens, ep, torch.device("cpu"))
    assert token_of_row.tolist() == [t for _ in range(ep) for t in range(num_tokens)]
    assert dest_of_row.tolist() == [r for r in range(ep) for _ in range(num_tokens)]
    assert row_of_slot.tolist() == [[r * num_tokens + t for r in range(ep)] for t in range(num_tokens)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows,num_local,num_slots", [
    (1, 1, 1), (129, 4, 2), (5000, 64, 8), (4097, 96, 8), (3000, 160, 4), (0, 8, 2), (70000, 32, 8)])
def test_received_row_map_kernels_match_the_reference(num_rows, num_local, num_slots):
    # Row counts around the kernels' row blocks, expert counts not a power of two, many row blocks; the reference
    # is the same function on the CPU.
    values = received_tails(num_rows, num_local, num_slots, seed=num_rows + num_local, device="cuda")
    num_routed = int((values > -math.inf).sum())
    (got_map, *got), (want_map, *want) = (received_row_map(v, num_slots, num_routed) for v in (values, values.cpu()))
    assert got_map.token_of_row.is_cuda
    assert torch.equal(got_map.token_of_row.cpu(), want_map.token_of_row)
    assert torch.equal(got_map.row_of_slot.cpu(), want_map.row_of_slot)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
