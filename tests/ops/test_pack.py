"""pack_rows / unpack_rows: the packed layout, agreement with the plain gathers, exact gradients through the
dispatcher's chains (pack -> reorder -> unpack), the custom ops' registrations, and on CUDA the Triton path against
the CPU (bitwise: the same gathers).

Legend: T tokens, K slots, R routed rows, H hidden, V values per row, W packed width.
"""

import pytest
import torch

from moe_core.ops.pack import pack_rows, packed_values, packed_width, unpack_rows
from moe_core.ops.permute import permute_rows, unpermute_rows
from moe_core.ops.triton_available import triton_available
from tests.ops.test_permute import random_maps, with_padding


@pytest.mark.parametrize("hidden,values,dtype,width", [
    (1, 1, torch.bfloat16, 32), (16, 1, torch.float32, 32), (40, 1, torch.float64, 64), (2048, 1, torch.bfloat16, 2064),
    (2048, 16, torch.bfloat16, 2080), (1024, 16, torch.float32, 1040), (7, 9, torch.float64, 32),
])
def test_packed_width_is_a_multiple_of_16_columns_holding_the_values(hidden, values, dtype, width):
    assert packed_width(hidden, values, dtype) == width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("hidden,num_values", [(1, 1), (7, 3), (16, 1), (40, 16)])
def test_packed_rows_hold_the_gathered_rows_zero_padding_and_the_values_bitwise(dtype, hidden, num_values):
    token_of_row, row_of_slot = random_maps(13, 3, 6, seed=hidden)
    token_of_row[::4] = -1  # padding rows: zeros, their values as given
    x = torch.randn(13, hidden).to(dtype)
    values = torch.randn(token_of_row.shape[0], num_values)
    packed = pack_rows(x, values, token_of_row.unsqueeze(1), row_of_slot)
    assert packed.shape == (token_of_row.shape[0], packed_width(hidden, num_values, dtype)) and packed.dtype == dtype
    assert torch.equal(packed[:, :hidden], permute_rows(x, token_of_row, row_of_slot))
    assert torch.equal(packed_values(packed, hidden, num_values).view(torch.int32), values.view(torch.int32))
    rest = packed[:, hidden:].contiguous().view(torch.uint8)
    assert torch.count_nonzero(rest) == torch.count_nonzero(values.view(torch.uint8))  # only the values' bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpacking_sums_like_unpermute_rows_and_returns_the_values(dtype):
    token_of_row, row_of_slot = random_maps(11, 4, 8, seed=5)
    hidden, num_rows = 24, token_of_row.shape[0]
    rows = torch.randn(num_rows, hidden).to(dtype)
    values = torch.rand(num_rows, 3)
    identity = torch.arange(num_rows).unsqueeze(1)
    packed = pack_rows(rows, values, identity, identity)
    summed, got = unpack_rows(packed, row_of_slot, token_of_row.unsqueeze(1), hidden, 3, torch.float32)
    assert torch.equal(summed, unpermute_rows(rows, token_of_row, row_of_slot, torch.float32))
    assert torch.equal(got, values)


def test_pack_reorder_unpack_chain_has_the_gradients_of_plain_indexing():
    """Send rows (a token once per destination), a permutation (the all-to-all), then each received row expanded
    to its experts' rows: output and gradients of x and of the per-row values equal those of indexing."""
    g = torch.Generator().manual_seed(0)
    send_rows, send_slots = random_maps(9, 2, 3, seed=7)  # tokens -> send rows, up to 2 per token
    num_sent = send_rows.shape[0]
    order = torch.randperm(num_sent, generator=g)
    recv_rows, recv_slots = random_maps(num_sent, 3, 5, seed=8)  # received rows -> expert rows, up to 3 each
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(num_sent, requires_grad=True)
    w = torch.randn(recv_rows.shape[0], 6, dtype=torch.float64)
    v = torch.randn(num_sent)

    packed = pack_rows(x, probs.unsqueeze(1), send_rows.unsqueeze(1), send_slots)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_sent)
    moved = permute_rows(packed, order, inverse.unsqueeze(1))  # the all-to-all stands in as a row permutation
    rows, values = unpack_rows(moved, recv_rows.unsqueeze(1), recv_slots, 6, 1)
    loss = (rows * w).sum() + (values[:, 0] * v).sum()
    grad_x, grad_probs = torch.autograd.grad(loss, [x, probs])

    x_ref, probs_ref = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    rows_ref = x_ref[send_rows][order][recv_rows]
    loss_ref = (rows_ref * w).sum() + (probs_ref[order] * v).sum()
    grad_x_ref, grad_probs_ref = torch.autograd.grad(loss_ref, [x_ref, probs_ref])
    assert torch.equal(rows, rows_ref.detach()) and torch.equal(values[:, 0], probs[order].detach())
    torch.testing.assert_close(grad_x, grad_x_ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(grad_probs, grad_probs_ref, rtol=0, atol=0)


def test_unused_outputs_get_zero_gradients():
    token_of_row, row_of_slot = random_maps(9, 2, 5, seed=3)
    x = torch.randn(9, 8, requires_grad=True)
    probs = torch.rand(token_of_row.shape[0], 1, requires_grad=True)
    rows, values = unpack_rows(pack_rows(x, probs, token_of_row.unsqueeze(1), row_of_slot), row_of_slot,
                               token_of_row.unsqueeze(1), 8, 1)
    grad_x, grad_probs = torch.autograd.grad(rows.sum(), [x, probs], retain_graph=True)
    assert torch.equal(grad_probs, torch.zeros_like(probs)) and grad_x.abs().sum() > 0
    grad_x, grad_probs = torch.autograd.grad(values.sum(), [x, probs])
    assert torch.equal(grad_x, torch.zeros_like(x)) and torch.equal(grad_probs, torch.ones_like(probs))


def test_bad_arguments_raise():
    token_of_row, row_of_slot = random_maps(5, 2, 4, seed=1)
    x, index = torch.randn(5, 8), token_of_row.unsqueeze(1)
    with pytest.raises(TypeError, match=r"values_MV: expected float32 \[\d+, V\], got torch.float64"):
        pack_rows(x, torch.rand(token_of_row.shape[0], 1, dtype=torch.float64), index, row_of_slot)
    with pytest.raises(ValueError, match=r"index / inverse: expected \[rows, K\] and \[5, K\]"):
        pack_rows(x, torch.rand(token_of_row.shape[0], 1), token_of_row, row_of_slot)
    with pytest.raises(ValueError, match=r"packed_MW: expected \[M, 32\] for hidden_size 8 and 1 values, got"):
        unpack_rows(torch.zeros(token_of_row.shape[0], 24), row_of_slot, index, 8, 1)


def test_opcheck():
    token_of_row, row_of_slot = random_maps(11, 3, 6, seed=2)
    x = torch.randn(11, 8, requires_grad=True)
    values = torch.rand(token_of_row.shape[0], 2, requires_grad=True)
    index = token_of_row.unsqueeze(1)
    torch.library.opcheck(torch.ops.moe_core.pack_rows, (x, values, index, row_of_slot, torch.float32))
    packed = pack_rows(x, values, index, row_of_slot).detach().requires_grad_()
    torch.library.opcheck(torch.ops.moe_core.unpack_rows, (packed, row_of_slot, index, 8, 2, torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,num_values", [(1, 1), (40, 16), (2048, 1), (4096, 16)])
def test_triton_path_equals_the_cpu_bitwise(dtype, hidden, num_values):
    token_of_row, row_of_slot = with_padding(*random_maps(300, 8, 64, seed=hidden), step=7)
    x = torch.randn(300, hidden).to(dtype)
    values = torch.rand(token_of_row.shape[0], num_values)
    packed_cpu = pack_rows(x, values, token_of_row.unsqueeze(1), row_of_slot)
    summed_cpu, values_cpu = unpack_rows(packed_cpu, row_of_slot, token_of_row.unsqueeze(1), hidden, num_values,
                                         torch.float32)
    torch.full((300 * packed_width(hidden, num_values, dtype) * 8,), float("nan"), device="cuda")  # poison
    x_c, values_c, rows_c, slots_c = (t.cuda() for t in (x, values, token_of_row.unsqueeze(1), row_of_slot))
    packed = pack_rows(x_c, values_c, rows_c, slots_c)
    summed, got = unpack_rows(packed, slots_c, rows_c, hidden, num_values, torch.float32)
    # Bitwise, as bytes: a tail's float32 bits read as bf16 can be NaN patterns, which torch.equal never equates.
    assert torch.equal(packed.cpu().view(torch.uint8), packed_cpu.view(torch.uint8))
    assert torch.equal(summed.cpu(), summed_cpu) and torch.equal(got.cpu(), values_cpu)
