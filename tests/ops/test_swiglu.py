"""swiglu_with_probs: the closed-form backward against float64 autograd, the custom op's registrations, and
on CUDA the Triton kernels against a float64 reference within twice PyTorch's own bf16 error.

Legend: R rows, F expert ffn width.
"""

import pytest
import torch
import torch.nn.functional as F

from moe_core.activations import activation
from moe_core.ops.reference import swiglu_with_probs_backward_ref, swiglu_with_probs_ref
from moe_core.ops.swiglu import swiglu_with_probs
from moe_core.ops.triton_available import triton_available


def plain(fc1_out, probs):
    """The unfused definition: the swiglu activation, then the probs."""
    return activation(fc1_out, "swiglu") * probs.unsqueeze(-1)


@pytest.mark.parametrize("rows,ffn", [(0, 4), (1, 1), (9, 37)])
def test_matches_unfused_definition_and_its_gradients_in_float64(rows, ffn):
    fc1 = torch.randn(rows, 2 * ffn, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(rows, dtype=torch.float64, requires_grad=True)
    out = swiglu_with_probs(fc1, probs)
    ref = plain(fc1, probs)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (fc1, probs), grad)
    want = torch.autograd.grad(ref, (fc1, probs), grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-14)


def test_gradcheck_and_opcheck():
    fc1 = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(swiglu_with_probs, (fc1, probs))
    torch.library.opcheck(torch.ops.moe_core.swiglu_with_probs, (fc1.float(), probs.float()))
    torch.library.opcheck(torch.ops.moe_core.swiglu_with_probs, (fc1.float(), probs.float(), torch.tensor(3)))


@pytest.mark.parametrize("used_rows", [None, torch.tensor(3)], ids=["all-rows", "used-rows"])
def test_gradgradcheck(used_rows):
    """Double backward (a gradient penalty through the experts) goes through the backward's own autograd formula."""
    fc1 = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(5, dtype=torch.float64, requires_grad=True)
    rows = 5 if used_rows is None else int(used_rows)

    def used(fc1, probs):
        return swiglu_with_probs(fc1, probs, used_rows)[:rows]

    torch.autograd.gradgradcheck(used, (fc1, probs))


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="fc1_out_RF2"):
        swiglu_with_probs(torch.randn(3, 5), torch.rand(3))
    with pytest.raises(ValueError, match="probs_R"):
        swiglu_with_probs(torch.randn(3, 4), torch.rand(2))
    for used_rows in (3, torch.tensor([3]), torch.tensor(3.0), torch.tensor(3 + 0j), torch.tensor(True)):
        with pytest.raises(TypeError, match="used_rows"):
            swiglu_with_probs(torch.randn(3, 4), torch.rand(3), used_rows)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_unused_rows_are_never_read(device):
    # Rows at or past used_rows hold NaN in every input; the used rows' outputs and gradients are those of the
    # used rows alone (the unused rows' are unspecified: unwritten on CUDA, computed on the CPU).
    if device == "cuda" and not (torch.cuda.is_available() and triton_available()):
        pytest.skip("needs CUDA and triton")
    torch.manual_seed(0)
    used, rows, ffn = 37, 100, 48
    fc1 = torch.randn(rows, 2 * ffn, device=device)
    probs = torch.rand(rows, device=device)
    grad = torch.randn(rows, ffn, device=device)
    for tensor in (fc1, probs, grad):
        tensor[used:] = float("nan")
    fc1.requires_grad_()
    probs.requires_grad_()
    out = swiglu_with_probs(fc1, probs, torch.tensor(used, device=device))
    out.backward(grad)
    fc1_used, probs_used = fc1.detach()[:used].double(), probs.detach()[:used].double()
    dfc1, dprobs = swiglu_with_probs_backward_ref(grad[:used].double(), fc1_used, probs_used)
    tol = dict(rtol=1e-5, atol=1e-5)  # float32 against float64
    torch.testing.assert_close(out[:used].double(), swiglu_with_probs_ref(fc1_used, probs_used), **tol)
    torch.testing.assert_close(fc1.grad[:used].double(), dfc1, **tol)
    torch.testing.assert_close(probs.grad[:used].double(), dprobs, **tol)


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("ffn", [8, 768, 1000, 14336])
def test_triton_within_twice_torch_bf16_error(ffn):
    from moe_core.ops.triton.swiglu import swiglu_probs_bwd, swiglu_probs_fwd

    torch.manual_seed(ffn)
    fc1 = torch.randn(257, 2 * ffn, device="cuda").bfloat16()
    probs = torch.rand(257, device="cuda")
    grad = torch.randn(257, ffn, device="cuda").bfloat16()
    fc1_64, probs_64, grad_64 = fc1.double(), probs.double(), grad.double()
    ref_out = swiglu_with_probs_ref(fc1_64, probs_64)
    ref_dfc1, ref_dprobs = swiglu_with_probs_backward_ref(grad_64, fc1_64, probs_64)
    torch.full((257 * 2 * ffn * 4,), float("nan"), device="cuda")  # poison free blocks
    out = swiglu_probs_fwd(fc1, probs, None)
    dfc1, dprobs = swiglu_probs_bwd(grad, fc1, probs, None)
    # PyTorch's own bf16 computation of the same function, the error budget's yardstick.
    torch_out = (F.silu(fc1[:, :ffn]) * fc1[:, ffn:] * probs.unsqueeze(-1)).bfloat16()
    budget = 2 * _rel_err(torch_out, ref_out) + 1e-6
    assert _rel_err(out, ref_out) <= budget
    assert _rel_err(dfc1, ref_dfc1) <= 2 * _rel_err(ref_dfc1.bfloat16(), ref_dfc1) + 1e-6
    assert _rel_err(dprobs, ref_dprobs) <= 1e-5
    assert not out.isnan().any() and not dfc1.isnan().any() and not dprobs.isnan().any()
