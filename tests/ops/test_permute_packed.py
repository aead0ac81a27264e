"""permute_rows_packed / unpermute_rows_packed: the packed layout, agreement with the unpacked ops, exact
gradients through a pack -> unpack chain (the dispatcher's), the custom ops' registrations, and on CUDA the
Triton path against the CPU (bitwise: the same gathers).

Legend: T tokens, K slots per token, R routed rows, H hidden, W packed width.
"""

import pytest
import torch

from moe_core.ops.permute import (
    packed_width,
    permute_rows,
    permute_rows_packed,
    unpermute_rows,
    unpermute_rows_packed,
)
from moe_core.ops.triton_available import triton_available
from tests.ops.test_permute import random_maps


def tail_probs(packed: torch.Tensor, hidden: int) -> torch.Tensor:
    start = packed_width(hidden) - 16
    return packed[:, start:].contiguous().view(torch.float32)[:, 0]


@pytest.mark.parametrize("hidden,width", [(1, 32), (16, 32), (40, 64), (2048, 2064)])
def test_packed_width_is_a_multiple_of_16_with_a_16_column_tail(hidden, width):
    assert packed_width(hidden) == width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("hidden", [1, 7, 16, 40])
def test_packed_rows_hold_the_permuted_rows_zero_padding_and_the_probs(dtype, hidden):
    token_of_row, row_of_slot = random_maps(13, 3, 6, seed=hidden)
    token_of_row[::4] = -1  # padding rows: zeros, their prob as given
    x = torch.randn(13, hidden).to(dtype)
    probs = torch.rand(token_of_row.shape[0])
    packed = permute_rows_packed(x, probs, token_of_row, row_of_slot)
    assert packed.shape == (token_of_row.shape[0], packed_width(hidden)) and packed.dtype == dtype
    assert torch.equal(packed[:, :hidden], permute_rows(x, token_of_row, row_of_slot))
    assert torch.equal(tail_probs(packed, hidden), probs)  # bitwise, whatever the row dtype
    rest = packed[:, hidden:].contiguous().view(torch.uint8)
    assert torch.count_nonzero(rest) == torch.count_nonzero(probs.view(torch.uint8))  # only the probs' bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpacking_sums_like_unpermute_rows_and_returns_the_probs(dtype):
    token_of_row, row_of_slot = random_maps(11, 4, 8, seed=5)
    hidden = 24
    rows = torch.randn(token_of_row.shape[0], hidden).to(dtype)
    probs = torch.rand(token_of_row.shape[0])
    packed = permute_rows_packed(rows, probs, torch.arange(rows.shape[0]), torch.arange(rows.shape[0])[:, None])
    summed, got_probs = unpermute_rows_packed(packed, token_of_row, row_of_slot, hidden, torch.float32)
    assert torch.equal(summed, unpermute_rows(rows, token_of_row, row_of_slot, torch.float32))
    assert torch.equal(got_probs, probs)


def test_pack_then_unpack_chain_has_the_gradients_of_plain_indexing():
    """The dispatcher's chain: permute into packed rows, reorder the rows (a permutation, as the all-to-all and
    the sort do), unpack. Gradients of x and probs equal those of the same function written with indexing."""
    token_of_row, row_of_slot = random_maps(17, 3, 7, seed=11)
    num_rows, hidden = token_of_row.shape[0], 9
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(0))  # output row i <- packed row
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_rows)
    x = torch.randn(17, hidden, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(num_rows, requires_grad=True)
    w_rows, w_probs = torch.randn(num_rows, hidden, dtype=torch.float64), torch.randn(num_rows)

    packed = permute_rows_packed(x, probs, token_of_row, row_of_slot)
    rows, probs_in_packed_order = unpermute_rows_packed(packed, inverse, order[:, None], hidden)
    loss = (rows * w_rows).sum() + (probs_in_packed_order[order] * w_probs).sum()
    grad_x, grad_probs = torch.autograd.grad(loss, [x, probs])

    x_ref, probs_ref = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    loss_ref = (x_ref[token_of_row][order] * w_rows).sum() + (probs_ref[order] * w_probs).sum()
    grad_x_ref, grad_probs_ref = torch.autograd.grad(loss_ref, [x_ref, probs_ref])
    torch.testing.assert_close(rows, x[token_of_row][order], rtol=0, atol=0)
    torch.testing.assert_close(grad_x, grad_x_ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(grad_probs, grad_probs_ref, rtol=0, atol=0)


def test_unused_outputs_get_zero_gradients():
    token_of_row, row_of_slot = random_maps(9, 2, 5, seed=3)
    x = torch.randn(9, 8, requires_grad=True)
    probs = torch.rand(token_of_row.shape[0], requires_grad=True)
    packed = permute_rows_packed(x, probs, token_of_row, row_of_slot)
    rows, _ = unpermute_rows_packed(packed, token_of_row, row_of_slot, 8)
    grad_x, grad_probs = torch.autograd.grad(rows.sum(), [x, probs])
    assert torch.equal(grad_probs, torch.zeros_like(probs)) and grad_x.abs().sum() > 0
    _, probs_out = unpermute_rows_packed(permute_rows_packed(x, probs, token_of_row, row_of_slot), token_of_row,
                                         row_of_slot, 8)
    grad_x, grad_probs = torch.autograd.grad(probs_out.sum(), [x, probs])
    assert torch.equal(grad_x, torch.zeros_like(x)) and torch.equal(grad_probs, torch.ones_like(probs))


def test_bad_arguments_raise():
    token_of_row, row_of_slot = random_maps(5, 2, 4, seed=1)
    x = torch.randn(5, 8)
    with pytest.raises(TypeError, match=r"probs_R: expected float32 \[\d+\], got torch.float64"):
        permute_rows_packed(x, torch.rand(token_of_row.shape[0], dtype=torch.float64), token_of_row, row_of_slot)
    with pytest.raises(ValueError, match=r"packed_RW: expected \[\d+, 32\] for hidden_size 8, got"):
        unpermute_rows_packed(torch.zeros(token_of_row.shape[0], 24), token_of_row, row_of_slot, 8)


def test_opcheck():
    token_of_row, row_of_slot = random_maps(11, 3, 6, seed=2)
    x = torch.randn(11, 8, requires_grad=True)
    probs = torch.rand(token_of_row.shape[0], requires_grad=True)
    torch.library.opcheck(torch.ops.moe_core.permute_rows_packed,
                          (x, probs, token_of_row, row_of_slot, torch.float32))
    packed = permute_rows_packed(x, probs, token_of_row, row_of_slot).detach().requires_grad_()
    torch.library.opcheck(torch.ops.moe_core.unpermute_rows_packed,
                          (packed, token_of_row, row_of_slot, 8, torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [1, 40, 2048, 4096])
def test_triton_packed_path_equals_the_cpu_bitwise(dtype, hidden):
    token_of_row, row_of_slot = random_maps(300, 8, 64, seed=hidden)
    token_of_row[::7] = -1
    x = torch.randn(300, hidden).to(dtype)
    probs = torch.rand(token_of_row.shape[0])
    packed_cpu = permute_rows_packed(x, probs, token_of_row, row_of_slot)
    summed_cpu, probs_cpu = unpermute_rows_packed(packed_cpu, token_of_row, row_of_slot, hidden, torch.float32)
    torch.full((300 * packed_width(hidden) * 8,), float("nan"), device="cuda")  # poison freed blocks
    cuda = [t.cuda() for t in (x, probs, token_of_row, row_of_slot)]
    packed = permute_rows_packed(*cuda)
    summed, got_probs = unpermute_rows_packed(packed, cuda[2], cuda[3], hidden, torch.float32)
    assert torch.equal(packed.cpu(), packed_cpu)
    assert torch.equal(summed.cpu(), summed_cpu) and torch.equal(got_probs.cpu(), probs_cpu)
