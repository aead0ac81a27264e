"""SharedExpertMLP.start: overlap only under EP, the same output and gradients as forward, and on CUDA the side
stream's result equal to the in-order one, forward and backward."""

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.moe.shared_experts import SharedExpertMLP


def make(ep: int = 2, overlap: bool = True, gate: bool = True) -> SharedExpertMLP:
    torch.manual_seed(0)
    return SharedExpertMLP(TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=gate, moe_shared_expert_overlap=overlap,
        expert_model_parallel_size=ep))


@pytest.mark.parametrize("ep,overlap,expected", [(1, True, False), (2, False, False), (2, True, True)])
def test_overlap_only_with_a_dispatcher_that_communicates(ep, overlap, expected):
    assert make(ep, overlap).overlap is expected


def test_start_on_cpu_is_forward_in_order():
    shared = make()
    x = torch.randn(5, 16, requires_grad=True)
    result = shared.start(x)
    expected = shared(x)
    assert torch.equal(result(), expected)


def _output_and_grads(shared: SharedExpertMLP, x: torch.Tensor, overlapped: bool):
    x = x.detach().requires_grad_()
    out = shared.start(x)() if overlapped else shared(x)
    grads = torch.autograd.grad((out * out).sum(), [x, *shared.parameters()])
    return (out.detach(), *grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_equals_in_order_on_cuda():
    shared = make().cuda()
    x = torch.randn(4096, 16, device="cuda")
    expected = _output_and_grads(shared, x, overlapped=False)
    got = _output_and_grads(shared, x, overlapped=True)
    torch.cuda.synchronize()
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)  # a stream race would give garbage, not rounding
