"""GroupedMLP (CUDA grouped GEMM) against SequentialMLP (per-expert nn.Linear) on the GPU, copied weights.

Legend: R routed rows, H hidden, F expert ffn width, E local experts.
"""

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.moe.experts import GroupedMLP, SequentialMLP, copy_sequential_to_grouped

pytestmark = pytest.mark.gpu

HIDDEN, FFN = 64, 96


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts", [[30, 0, 51, 7], [0, 0, 0, 0], [0, 140, 0, 1]], ids=["empty-mid", "R0", "skewed"])
def test_grouped_matches_sequential_on_cuda(dtype, counts):
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=4,
                               moe_ffn_hidden_size=FFN, activation_func="swiglu", add_bias_linear=True)
    torch.manual_seed(0)
    sequential = SequentialMLP(4, config).cuda().to(dtype)
    grouped = GroupedMLP(4, config).cuda().to(dtype)
    with torch.no_grad():
        for name, p in sequential.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    copy_sequential_to_grouped(sequential, grouped)
    rows = sum(counts)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype)
    probs = torch.rand(rows, device="cuda")
    grad_out = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype)

    results = []
    for module in (sequential, grouped):
        xi, pi = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out, _ = module(xi, torch.tensor(counts, device="cuda"), pi)
        out.backward(grad_out)
        results.append((out.detach(), xi.grad, pi.grad))
    # bf16: both sides accumulate in fp32 but round intermediates (fc1 output, activations) in different places,
    # so single elements may differ by an ulp or two; the norm-wise error must stay at bf16's resolution.
    max_rel = 1e-5 if dtype == torch.float32 else 1e-2
    for ours, ref in zip(results[1], results[0], strict=True):
        assert rel_err(ours, ref) <= max_rel
    for e, expert in enumerate(sequential.local_experts):
        for seq_lin, grp_lin in ((expert.linear_fc1, grouped.linear_fc1), (expert.linear_fc2, grouped.linear_fc2)):
            g = grp_lin.weight.grad[e]
            if counts[e] == 0:
                assert torch.equal(g, torch.zeros_like(g)), "an expert without rows gets an exact-zero gradient"
            else:
                assert rel_err(g, seq_lin.weight.grad.t()) <= max_rel


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
