"""Gradients of gradients through grouped_gemm (``grouped_gemm_wgrad``'s autograd) against float64
double-backward of the pure-PyTorch reference, gradcheck/gradgradcheck, and counts that overflow int64.

Legend: T rows, K reduction width, N output width, E experts.
"""

import pytest
import torch

from moe_core.ops import grouped_gemm
from moe_core.ops.reference import grouped_gemm_ref

COUNTS = [[2, 0, 3], [0, 0, 0], [5], [0, 4, 0, 1]]


def _weight_gradient_penalty(op, x, w, counts, trans_weight):
    """``d/dx ||dL/dw||^2`` and ``d/dw ||dL/dw||^2`` for ``L = sum(op(x, w) ** 2)`` (a gradient penalty)."""
    y = op(x, w, counts, trans_weight)
    dw, = torch.autograd.grad(y.square().sum(), w, create_graph=True)
    return torch.autograd.grad(dw.square().sum(), (x, w), allow_unused=True)


@pytest.mark.parametrize("trans_weight", [False, True])
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_double_backward_matches_float64_reference(counts, trans_weight):
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    k, n = 3, 4
    x = torch.randn(int(counts.sum()), k, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(counts), *((n, k) if trans_weight else (k, n)), dtype=torch.float64, requires_grad=True)
    ours = _weight_gradient_penalty(lambda *a: grouped_gemm(*a[:3], trans_weight=a[3]), x, w, counts, trans_weight)
    ref = _weight_gradient_penalty(grouped_gemm_ref, x, w, counts, trans_weight)
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if x.numel():
        assert ref[0].abs().sum() > 1  # the case the issue reported: not 0


@pytest.mark.parametrize("trans_weight", [False, True])
def test_wgrad_gradcheck_and_gradgradcheck(trans_weight):
    counts = torch.tensor([2, 0, 3, 1])
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)

    def wgrad(x, dy):
        return torch.ops.moe_core.grouped_gemm_wgrad(x, dy, counts, trans_weight)

    assert torch.autograd.gradcheck(wgrad, (x, dy))
    assert torch.autograd.gradgradcheck(wgrad, (x, dy))
    torch.library.opcheck(torch.ops.moe_core.grouped_gemm_wgrad.default, (x, dy, counts, trans_weight))


def test_counts_that_overflow_int64_name_the_argument():
    # The int64 sum wraps around to T = 5: only a per-count bound catches it.
    counts = torch.tensor([2**63 - 1, 2**63 - 1, 7])
    assert int(counts.sum()) == 5
    with pytest.raises(ValueError, match=r"tokens_per_expert: a count exceeds T = 5 \(x's rows\)"):
        grouped_gemm(torch.randn(5, 3), torch.randn(3, 3, 4), counts)
