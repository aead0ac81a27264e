"""GroupedMLP against SequentialMLP (copied weights) and a per-row float64 formula, with the probs applied
before fc2 and on the output (``moe_apply_probs_on_output``); zero-token experts.

Legend: R routed rows, H hidden, F expert ffn width, E local experts.
"""

import math

import pytest
import torch

from moe_core.activations import activation
from moe_core.config import ACTIVATIONS, TransformerConfig
from moe_core.moe.experts import GroupedMLP, SequentialMLP, copy_sequential_to_grouped

HIDDEN, FFN = 8, 6
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}


def make_config(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=4, moe_ffn_hidden_size=FFN)
    return TransformerConfig(**{**base, **kw})


def make_pair(num_experts: int, dtype: torch.dtype, **kw) -> tuple[SequentialMLP, GroupedMLP]:
    config = make_config(**kw)
    torch.manual_seed(0)
    sequential = SequentialMLP(num_experts, config).to(dtype)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in sequential.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    grouped = GroupedMLP(num_experts, config).to(dtype)
    copy_sequential_to_grouped(sequential, grouped)
    return sequential, grouped


def per_row_reference(grouped: GroupedMLP, x, counts, probs) -> torch.Tensor:
    """p * (act(x @ W1_e + b1_e) @ W2_e + b2_e), row by row, in float64."""
    fc1, fc2 = grouped.linear_fc1, grouped.linear_fc2
    w1, w2 = fc1.weight.double(), fc2.weight.double()
    b1 = fc1.bias.double() if fc1.bias is not None else torch.zeros(w1.shape[0], w1.shape[2])
    b2 = fc2.bias.double() if fc2.bias is not None else torch.zeros(w2.shape[0], w2.shape[2])
    expert_of_row = [e for e, c in enumerate(counts) for _ in range(c)]
    rows = [probs[r].double() * (activation(x[r].double() @ w1[e] + b1[e], grouped.activation_func) @ w2[e] + b2[e])
            for r, e in enumerate(expert_of_row)]
    return torch.stack(rows) if rows else torch.zeros(0, w2.shape[2], dtype=torch.float64)


def run(module, x, counts, probs, grad_out):
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, bias = module(x, torch.tensor(counts), probs)
    assert bias is None
    out.backward(grad_out)
    for name, param in module.named_parameters():
        assert param.grad is not None, f"{name} got no grad (every expert's linears must run, also with R == 0)"
    return out.detach(), x.grad, probs.grad


def expert_grads(sequential: SequentialMLP, grouped: GroupedMLP, e: int):
    """Pairs (grouped grad, sequential grad) of expert e, sequential ones transposed to [in, out]."""
    seq = sequential.local_experts[e]
    pairs = [(grouped.linear_fc1.weight.grad[e], seq.linear_fc1.weight.grad.t()),
             (grouped.linear_fc2.weight.grad[e], seq.linear_fc2.weight.grad.t())]
    if grouped.linear_fc1.bias is not None:
        pairs += [(grouped.linear_fc1.bias.grad[e], seq.linear_fc1.bias.grad),
                  (grouped.linear_fc2.bias.grad[e], seq.linear_fc2.bias.grad)]
    return pairs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [2, 4, 1, 0], [0, 0, 0, 0]], ids=["empty-mid", "empty-last", "R0"])
@pytest.mark.parametrize("on_output", [False, True], ids=["probs-before-fc2", "probs-on-output"])
def test_grouped_matches_sequential(dtype, bias, act, counts, on_output):
    sequential, grouped = make_pair(len(counts), dtype, activation_func=act, add_bias_linear=bias,
                                    moe_apply_probs_on_output=on_output)
    g = torch.Generator().manual_seed(sum(counts))
    num_rows = sum(counts)
    x = torch.randn(num_rows, HIDDEN, generator=g, dtype=dtype)
    probs = torch.rand(num_rows, generator=g, dtype=dtype)
    grad_out = torch.randn(num_rows, HIDDEN, generator=g, dtype=dtype)

    out_s, dx_s, dp_s = run(sequential, x, counts, probs, grad_out)
    out_g, dx_g, dp_g = run(grouped, x, counts, probs, grad_out)
    assert out_g.shape == (num_rows, HIDDEN) and out_g.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out_g, out_s, **tol)
    torch.testing.assert_close(out_g.double(), per_row_reference(grouped, x, counts, probs), **tol)
    if num_rows == 0:  # no rows, nothing to differentiate: an empty grad or None (ops may skip dgrad)
        assert all(g is None or g.numel() == 0 for g in (dx_g, dp_g, dx_s, dp_s))
    else:
        torch.testing.assert_close(dx_g, dx_s, **tol)
        torch.testing.assert_close(dp_g, dp_s, **tol)
    for e, count in enumerate(counts):
        for got, want in expert_grads(sequential, grouped, e):
            assert got is not None and want is not None
            torch.testing.assert_close(got, want, **tol)
            if count == 0:
                assert torch.equal(got, torch.zeros_like(got)), f"expert {e} has no rows: grad must be exactly 0"
                assert torch.equal(want, torch.zeros_like(want))


@pytest.mark.parametrize("on_output", [False, True])
def test_padding_row_with_zero_prob_gives_exact_zero(on_output):
    """A drop_and_pad padding row (prob 0) must come out as exactly 0, bias or not: combine only sums."""
    _, grouped = make_pair(2, torch.float32, add_bias_linear=True, moe_apply_probs_on_output=on_output)
    with torch.no_grad():
        grouped.linear_fc2.bias.normal_()
    out, _ = grouped(torch.randn(4, HIDDEN), torch.tensor([2, 2]), torch.tensor([0.5, 0.0, 0.0, 1.0]))
    assert torch.equal(out[1:3], torch.zeros(2, HIDDEN))
    assert out[0].abs().sum() > 0 and out[3].abs().sum() > 0


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("on_output", [False, True], ids=["probs-before-fc2", "probs-on-output"])
def test_unused_rows_past_the_counts_sum(bias, on_output):
    """Counts summing to less than R (the sync-free dispatch's static row bound): the rows past the sum are never
    read (NaN in x, probs and the output's gradient there), and every other output and every gradient is the one
    of the rows alone, bias or not, for GroupedMLP and SequentialMLP."""
    counts, num_padding = [3, 0, 5, 1], 7
    routed = sum(counts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(routed + num_padding, HIDDEN, generator=g, dtype=torch.float64)
    probs = torch.rand(routed + num_padding, generator=g, dtype=torch.float64)
    grad_out = torch.randn(routed + num_padding, HIDDEN, generator=g, dtype=torch.float64)
    for tensor in (x, probs, grad_out):
        tensor[routed:] = float("nan")
    for module in make_pair(len(counts), torch.float64, add_bias_linear=bias, moe_apply_probs_on_output=on_output):
        out, dx, dp = run(module, x, counts, probs, grad_out)
        grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad()
        out_rows, dx_rows, dp_rows = run(module, x[:routed], counts, probs[:routed], grad_out[:routed])
        torch.testing.assert_close(out[:routed], out_rows, **TOL[torch.float64])
        torch.testing.assert_close(dx[:routed], dx_rows, **TOL[torch.float64])
        torch.testing.assert_close(dp[:routed], dp_rows, **TOL[torch.float64])
        for got, want in zip(grads, (p.grad for p in module.parameters()), strict=True):
            torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_grouped_parameters_and_init():
    config = make_config(hidden_size=64, moe_ffn_hidden_size=64, num_layers=8, activation_func="swiglu",
                         add_bias_linear=True, init_method_std=0.02)
    grouped = GroupedMLP(4, config)
    shapes = {name: tuple(p.shape) for name, p in grouped.named_parameters()}
    assert shapes == {"linear_fc1.weight": (4, 64, 128), "linear_fc1.bias": (4, 128), "linear_fc2.weight": (4, 64, 64),
                      "linear_fc2.bias": (4, 64)}
    assert math.isclose(grouped.linear_fc1.weight.std().item(), 0.02, rel_tol=0.05)
    # fc2: 1 / sqrt(2 * layers)
    assert math.isclose(grouped.linear_fc2.weight.std().item(), 0.02 / math.sqrt(16), rel_tol=0.05)
    assert torch.equal(grouped.linear_fc1.bias, torch.zeros(4, 128))
    sequential = SequentialMLP(4, config)
    assert math.isclose(sequential.local_experts[0].linear_fc2.weight.std().item(), 0.005, rel_tol=0.1)


def test_experts_reject_bad_inputs():
    sequential, grouped = make_pair(3, torch.float32)
    x, probs = torch.randn(5, HIDDEN), torch.rand(5)
    for module in (sequential, grouped):
        with pytest.raises(ValueError, match="permuted_local_hidden_states"):
            module(torch.randn(5, HIDDEN + 1), torch.tensor([1, 2, 2]), probs)
        with pytest.raises(ValueError, match="tokens_per_expert"):
            module(x, torch.tensor([3, 2]), probs)
        with pytest.raises(TypeError, match="tokens_per_expert"):
            module(x, torch.tensor([1.0, 2.0, 2.0]), probs)
        with pytest.raises(ValueError, match="permuted_probs"):
            module(x, torch.tensor([1, 2, 2]), probs[:4])
    for module in (sequential, grouped):  # counts past R (the grouped GEMM checks CPU counts)
        with pytest.raises(ValueError, match="tokens_per_expert"):
            module(x, torch.tensor([1, 2, 3]), probs)
    with pytest.raises(ValueError, match="num_local_experts"):
        GroupedMLP(0, make_config())
    _, other = make_pair(2, torch.float32)
    with pytest.raises(ValueError, match="grouped"):
        copy_sequential_to_grouped(sequential, other)


def test_activations_by_hand():
    x = torch.randn(3, 2 * FFN, dtype=torch.float64)
    gate, up = x[:, :FFN], x[:, FFN:]  # gated: the first half goes through the activation (Megatron)
    gelu = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    expected = {
        "swiglu": gate * torch.sigmoid(gate) * up,
        "geglu": gelu[:, :FFN] * up,
        "gelu": gelu,
        "silu": x * torch.sigmoid(x),
        "relu": x.clamp(min=0),
        "squared_relu": x.clamp(min=0) ** 2,
    }
    assert set(expected) == set(ACTIVATIONS)
    for name, want in expected.items():
        torch.testing.assert_close(activation(x, name), want, rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="name"):
        activation(x, "tanh")
    with pytest.raises(ValueError, match="even"):
        activation(x[:, :5], "swiglu")
