"""permute_rows / unpermute_rows: references against loops, the custom ops' registrations, and on CUDA the
Triton kernels against the references (bitwise: same gathers, same float32 summation order).

Legend: T tokens, K slots per token, R routed rows, H hidden.
"""

import pytest
import torch

from moe_core.ops.permute import permute_rows, unpermute_rows
from moe_core.ops.reference import gather_rows_ref, gather_sum_rows_ref
from moe_core.ops.triton_available import triton_available


def random_maps(num_tokens: int, num_slots: int, num_experts: int, seed: int, device="cpu"):
    """A routing of each token to up to ``num_slots`` distinct experts (some slots empty), as row maps."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, scores.topk(num_slots, dim=1).indices, True)
    routing_map &= torch.rand(num_tokens, num_experts, generator=g) > 0.2  # drop some: empty slots
    token_of_row = [t for e in range(num_experts) for t in range(num_tokens) if routing_map[t, e]]
    row_of_slot = torch.full((num_tokens, num_slots), -1, dtype=torch.int64)
    for r, t in enumerate(token_of_row):
        k = int((row_of_slot[t] >= 0).sum())
        row_of_slot[t, k] = r
    return torch.tensor(token_of_row, dtype=torch.int64).to(device), row_of_slot.to(device)


@pytest.mark.parametrize("num_tokens,num_slots", [(0, 2), (1, 1), (13, 3), (40, 8)])
def test_references_against_loops(num_tokens, num_slots):
    token_of_row, row_of_slot = random_maps(num_tokens, num_slots, 10, seed=num_tokens)
    x = torch.randn(num_tokens, 7, dtype=torch.float64)
    permuted = gather_rows_ref(x, token_of_row, torch.float64)
    assert torch.equal(permuted, x[token_of_row])
    y = torch.randn(token_of_row.shape[0], 7, dtype=torch.float64)
    out = gather_sum_rows_ref(y, row_of_slot, torch.float64)
    for t in range(num_tokens):
        rows = [r for r in row_of_slot[t].tolist() if r >= 0]
        want = y[rows].sum(0) if rows else torch.zeros(7, dtype=torch.float64)
        torch.testing.assert_close(out[t], want, rtol=0, atol=1e-14)


def test_padding_rows_are_zero_and_get_no_gradient():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    token_of_row = torch.tensor([2, -1, 0, -1])
    row_of_slot = torch.tensor([[2], [-1], [0]])
    permuted = permute_rows(x, token_of_row, row_of_slot)
    assert torch.equal(permuted[1], torch.zeros(4, dtype=torch.float64))
    y = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    out = unpermute_rows(y, token_of_row, row_of_slot)
    (grad_y,) = torch.autograd.grad(out, y, torch.ones_like(out))
    assert torch.equal(grad_y[1], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(grad_y[3], torch.zeros(4, dtype=torch.float64))


def test_gradients_against_float64_autograd_of_indexing():
    token_of_row, row_of_slot = random_maps(17, 4, 9, seed=3)
    x = torch.randn(17, 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x: permute_rows(x, token_of_row, row_of_slot), (x,))
    y = torch.randn(token_of_row.shape[0], 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda y: unpermute_rows(y, token_of_row, row_of_slot), (y,))
    torch.autograd.gradgradcheck(lambda y: unpermute_rows(y, token_of_row, row_of_slot), (y,))


def test_out_dtype_casts_once():
    token_of_row, row_of_slot = random_maps(9, 2, 4, seed=1)
    x = torch.randn(9, 6)
    got = permute_rows(x, token_of_row, row_of_slot, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, x[token_of_row].bfloat16())


@pytest.mark.parametrize("op", ["permute_rows", "unpermute_rows"])
def test_opcheck(op):
    token_of_row, row_of_slot = random_maps(11, 3, 6, seed=2)
    src_rows = 11 if op == "permute_rows" else token_of_row.shape[0]
    src = torch.randn(src_rows, 8, requires_grad=True)
    torch.library.opcheck(getattr(torch.ops.moe_core, op), (src, token_of_row, row_of_slot, torch.float32))


def with_padding(token_of_row: torch.Tensor, row_of_slot: torch.Tensor, step: int):
    """The same maps with a padding row (token -1) before row 0 and after every ``step`` routed rows."""
    num_rows = token_of_row.shape[0]
    new_row = torch.arange(num_rows, device=token_of_row.device)
    new_row += new_row // step + 1
    padded = torch.full((num_rows + (num_rows - 1) // step + 2 if num_rows else 1,), -1, dtype=torch.int64,
                        device=token_of_row.device)
    padded[new_row] = token_of_row
    return padded, torch.where(row_of_slot >= 0, new_row[row_of_slot.clamp_min(0)], -1)


def test_with_padding_keeps_the_maps_inverse():
    token_of_row, row_of_slot = with_padding(*random_maps(30, 4, 8, seed=5), step=6)
    assert (token_of_row[0] == -1) and int((token_of_row < 0).sum()) > 1
    listed = row_of_slot[row_of_slot >= 0]
    assert torch.equal(listed.sort().values, (token_of_row >= 0).nonzero().squeeze(1))
    for t, rows in enumerate(row_of_slot.tolist()):
        assert all(token_of_row[r] == t for r in rows if r >= 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("src_dtype,out_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("hidden", [1, 40, 2048, 7168])
def test_triton_kernels_equal_references_bitwise(src_dtype, out_dtype, hidden):
    from moe_core.ops.triton.permute import gather_sum_rows_into, scatter_rows_into

    token_of_row, row_of_slot = with_padding(*random_maps(300, 8, 64, seed=hidden, device="cuda"), step=7)
    x = torch.randn(300, hidden, device="cuda").to(src_dtype)
    y = torch.randn(token_of_row.shape[0], hidden, device="cuda").to(src_dtype)
    # Poison the allocator's free blocks so an unwritten element shows as NaN.
    torch.full((300 * hidden * 8,), float("nan"), device="cuda")
    scattered = scatter_rows_into(x, row_of_slot, token_of_row,
                                  x.new_empty(token_of_row.shape[0], hidden, dtype=out_dtype))
    summed = gather_sum_rows_into(y, row_of_slot, y.new_empty(300, hidden, dtype=out_dtype))
    assert torch.equal(scattered, gather_rows_ref(x, token_of_row, out_dtype))
    assert torch.equal(summed, gather_sum_rows_ref(y, row_of_slot, out_dtype))
    assert not scattered.isnan().any() and not summed.isnan().any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("num_tokens", [0, 5])
def test_scatter_writes_rows_that_are_all_padding(num_tokens):
    from moe_core.ops.triton.permute import scatter_rows_into

    row_of_slot = torch.full((num_tokens, 2), -1, dtype=torch.int64, device="cuda")
    token_of_row = torch.full((37,), -1, dtype=torch.int64, device="cuda")
    out = torch.full((37, 600), float("nan"), device="cuda")
    scatter_rows_into(torch.randn(num_tokens, 600, device="cuda"), row_of_slot, token_of_row, out)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
def test_scatter_leaves_unused_rows_alone():
    # Unused rows (token -2, past the routed rows under a row bound) stay as they were; padding rows (-1) get zeros
    # and routed rows their token: the negative control is the padding row next to the unused ones.
    from moe_core.ops.triton.permute import scatter_rows_into

    token_of_row, row_of_slot = with_padding(*random_maps(40, 4, 8, seed=1, device="cuda"), step=9)
    token_of_row = torch.cat([token_of_row, torch.full((50,), -2, dtype=torch.int64, device="cuda")])
    x = torch.randn(40, 600, device="cuda")
    out = torch.full((token_of_row.shape[0], 600), float("nan"), device="cuda")
    scatter_rows_into(x, row_of_slot, token_of_row, out)
    used = token_of_row >= -1
    assert torch.equal(out[used], gather_rows_ref(x, token_of_row[used], torch.float32))
    assert out[~used].isnan().all()
