"""MoELayer against a token-by-token float64 reference; gradients reach every parameter.

Legend: B batch, S sequence, N = B * S tokens, H hidden, E experts.
"""

import pytest
import torch

from moe_core.activations import activation
from moe_core.config import TransformerConfig
from moe_core.moe.experts import GroupedMLP, copy_sequential_to_grouped
from moe_core.moe.moe_layer import MoELayer
from moe_core.moe.token_dispatcher import MoELocalTokenDispatcher

HIDDEN = 8


def make_layer(dtype=torch.float64, **kw) -> MoELayer:
    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=6, init_method_std=0.3, moe_router_dtype="fp64")
    torch.manual_seed(0)
    layer = MoELayer(TransformerConfig(**{**base, **kw})).to(dtype)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return layer


def expert_mlp(layer: MoELayer, e: int, x_H: torch.Tensor) -> torch.Tensor:
    """Expert e on one token, read from whichever expert module the layer holds."""
    act = layer.config.activation_func
    if isinstance(layer.experts, GroupedMLP):
        fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
        h = x_H @ fc1.weight[e] + (fc1.bias[e] if fc1.bias is not None else 0)
        return activation(h, act) @ fc2.weight[e] + (fc2.bias[e] if fc2.bias is not None else 0)
    mlp = layer.experts.local_experts[e]
    return mlp.linear_fc2(activation(mlp.linear_fc1(x_H), act))


def shared_mlp(layer: MoELayer, x_H: torch.Tensor) -> torch.Tensor:
    shared = layer.shared_experts
    out = shared.linear_fc2(activation(shared.linear_fc1(x_H), layer.config.activation_func))
    if shared.gate_weight is not None:
        out = out * torch.sigmoid(x_H @ shared.gate_weight[0])
    return out


def reference(layer: MoELayer, hidden: torch.Tensor) -> torch.Tensor:
    """sum over the selected experts of prob * expert_mlp(token) (+ shared expert), one token at a time."""
    probs, routing_map = layer.router(hidden if hidden.dim() == 3 else hidden.reshape(-1, HIDDEN))
    tokens = hidden.reshape(-1, HIDDEN).double()
    rows = []
    for n, x in enumerate(tokens):
        out = torch.zeros(HIDDEN, dtype=torch.float64)
        for e in routing_map[n].nonzero().flatten().tolist():
            out = out + probs[n, e].double() * expert_mlp(layer, e, x)
        if layer.shared_experts is not None:
            out = out + shared_mlp(layer, x)
        rows.append(out)
    return torch.stack(rows).view(hidden.shape)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(activation_func="gelu", add_bias_linear=True),
    dict(moe_shared_expert_intermediate_size=10),
    dict(moe_shared_expert_intermediate_size=10, moe_shared_expert_gate=True, activation_func="geglu"),
    dict(moe_expert_capacity_factor=1.0),
    dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True, add_bias_linear=True),
], ids=["swiglu", "gelu-bias", "shared", "shared-gate-geglu", "drop", "drop-and-pad-bias"])
def test_layer_matches_token_by_token_reference(grouped, kw):
    layer = make_layer(moe_grouped_gemm=grouped, **kw).eval()
    hidden = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    out = layer(hidden)
    assert out.shape == hidden.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, reference(layer, hidden), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 3, HIDDEN), (7, HIDDEN), (2, 2, 2, HIDDEN)], ids=["BSH", "NH", "4d"])
def test_forward_backward_shapes_and_every_param_gets_grad(shape):
    layer = make_layer(torch.float32, moe_shared_expert_intermediate_size=10, moe_shared_expert_gate=True,
                       add_bias_linear=True, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01)
    assert isinstance(layer.token_dispatcher, MoELocalTokenDispatcher)
    hidden = torch.randn(*shape, requires_grad=True)
    out = layer(hidden)
    assert out.shape == hidden.shape and out.dtype == torch.float32
    out.square().sum().backward()
    assert hidden.grad.shape == hidden.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None, f"{name} got no grad"
        assert p.grad.abs().sum() > 0, f"{name}'s grad is all zeros"


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_expert_without_tokens_gets_exact_zero_grad(grouped):
    layer = make_layer(torch.float32, moe_grouped_gemm=grouped, moe_router_enable_expert_bias=True,
                       add_bias_linear=True)
    layer.router.expert_bias[0] = -1e4  # selection only: expert 0 never wins a top-2 slot
    hidden = torch.randn(3, 4, HIDDEN)
    layer(hidden).square().sum().backward()
    assert layer.router.recorder.tokens_per_expert[0] == 0
    assert layer.router.weight.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None, f"{name} got no grad"
    if grouped:
        expert0 = [layer.experts.linear_fc1.weight.grad[0], layer.experts.linear_fc2.weight.grad[0],
                   layer.experts.linear_fc1.bias.grad[0], layer.experts.linear_fc2.bias.grad[0]]
        assert layer.experts.linear_fc1.weight.grad[1:].abs().sum() > 0
    else:
        expert0 = [p.grad for p in layer.experts.local_experts[0].parameters()]
    for g in expert0:
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("kw", [{}, dict(add_bias_linear=True, moe_shared_expert_intermediate_size=10)],
                         ids=["swiglu", "bias-shared"])
def test_double_backward_matches_sequential_mlp(kw):
    """A gradient penalty (create_graph=True through the fused SwiGLU, the grouped GEMM and the permutes) gives
    GroupedMLP's layer the gradients of the SequentialMLP layer with the same weights."""
    grouped, sequential = make_layer(**kw), make_layer(moe_grouped_gemm=False, **kw)
    sequential.load_state_dict({k: v for k, v in grouped.state_dict().items() if not k.startswith("experts.")},
                               strict=False)
    copy_sequential_to_grouped(sequential.experts, grouped.experts)
    hidden = torch.randn(3, 4, HIDDEN, dtype=torch.float64)
    grads = []
    for layer in (grouped, sequential):
        x = hidden.clone().requires_grad_()
        dx, = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        dx.square().sum().backward()
        grads.append((x.grad, layer.router.weight.grad, [g for e in range(4) for g in expert_weight_grads(layer, e)]))
    (dx_g, router_g, experts_g), (dx_s, router_s, experts_s) = grads
    torch.testing.assert_close(dx_g, dx_s, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(router_g, router_s, rtol=1e-10, atol=1e-12)
    for g, s in zip(experts_g, experts_s, strict=True):
        torch.testing.assert_close(g, s, rtol=1e-10, atol=1e-12)


def expert_weight_grads(layer: MoELayer, e: int) -> list[torch.Tensor]:
    """Expert e's fc1 and fc2 weight gradients as [in, out], from either expert module."""
    if isinstance(layer.experts, GroupedMLP):
        return [layer.experts.linear_fc1.weight.grad[e], layer.experts.linear_fc2.weight.grad[e]]
    mlp = layer.experts.local_experts[e]
    return [mlp.linear_fc1.weight.grad.t(), mlp.linear_fc2.weight.grad.t()]


def test_layer_rejects_bad_hidden():
    layer = make_layer()
    with pytest.raises(ValueError, match="hidden"):
        layer(torch.randn(3, HIDDEN + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_moe_experts"):
        MoELayer(TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2))


@pytest.mark.parametrize("kw", [{}, {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 1e-3},
                                {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}],
                         ids=["plain", "aux-and-z-loss", "drop-and-pad"])
def test_layer_compiles_without_graph_breaks(kw):
    """torch.compile(fullgraph=True) traces the whole layer (router, dispatch, experts, combine): no host sync
    and no graph break; the compiled layer computes the eager layer's outputs and gradients."""
    layer = make_layer(dtype=torch.float32, **kw)
    hidden = torch.randn(2, 16, layer.config.hidden_size, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(hidden)
    want = layer(hidden)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), [hidden, *layer.parameters()])
    want_grads = torch.autograd.grad(want.square().sum(), [hidden, *layer.parameters()])
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "negative_control"])
def test_rows_reach_the_experts_in_the_autocast_dtype(autocast):
    """Under bf16 autocast the float32 tokens are cast once, inside the permute: the experts receive bf16 rows and
    the combined output is bf16; without autocast the rows stay float32."""
    layer = make_layer(torch.float32, moe_router_dtype="fp32")
    seen = []
    layer.experts.register_forward_pre_hook(lambda _module, args: seen.append(args[0].dtype))
    x = torch.randn(2, 5, HIDDEN, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)
    out.float().sum().backward()
    expected = torch.bfloat16 if autocast else torch.float32
    assert seen == [expected] and out.dtype == expected
    assert x.grad.dtype == torch.float32 and layer.experts.linear_fc1.weight.grad.dtype == torch.float32
