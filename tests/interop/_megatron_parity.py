"""Parity of two Megatron ``MoELayer``s that differ in their experts: Megatron's ``SequentialMLP`` and moe_core's,
on the same weights, in float64. The two sum the same products in a different order (one grouped GEMM against a
GEMM per expert), so on the CPU outputs and every gradient agree within ``rtol=1e-12, atol=1e-12``; on CUDA
moe_core's fused SwiGLU (Triton) computes in float32, and the bound is ``rtol=1e-5, atol=1e-5``."""

from __future__ import annotations

import torch

from moe_core.interop.megatron import MoECoreGroupedMLP, with_moe_core_experts
from tests.interop._megatron_env import build, moe_layer_spec


def tolerance(device: torch.device) -> dict:
    """``torch.testing.assert_close``'s tolerances for float64 parity on ``device`` (see the module docstring)."""
    return dict(rtol=1e-12, atol=1e-12) if device.type == "cpu" else dict(rtol=1e-5, atol=1e-5)


def megatron_layer_pair(config, experts=MoECoreGroupedMLP, convert_keys=lambda state_dict: state_dict):
    """Megatron's MoELayer with SequentialMLP experts, and the same layer with ``experts``, loaded from the first
    one's state dict (SequentialMLP's keys, passed through ``convert_keys``)."""
    spec = moe_layer_spec(config)
    reference = build(spec, config=config)
    ours = build(with_moe_core_experts(spec, experts), config=config)
    ours.load_state_dict(convert_keys(reference.state_dict()))
    return reference, ours


def record_tokens_per_expert(layer) -> list[int]:
    """A list that collects the ``tokens_per_expert`` the layer's experts receive on each call."""
    counts: list[int] = []
    layer.experts.register_forward_pre_hook(lambda module, args: counts.extend(args[1].tolist()))
    return counts


def _forward_backward(layer, x, grad_out):
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    out.backward(grad_out)
    return out.detach(), x.grad


def assert_layers_agree(reference, ours, x: torch.Tensor) -> None:
    """Outputs and gradients (input, router, each expert's weights and biases) of the two layers agree on
    ``x`` [S, B, H] and a fixed random output gradient."""
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype).to(x.device)
    out_ref, dx_ref = _forward_backward(reference, x, grad_out)
    out, dx = _forward_backward(ours, x, grad_out)
    tol = tolerance(x.device)
    torch.testing.assert_close(out, out_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    torch.testing.assert_close(ours.router.weight.grad, reference.router.weight.grad, **tol)
    for e, expert in enumerate(reference.experts.local_experts):
        for name in ("linear_fc1", "linear_fc2"):
            ref_linear, linear = getattr(expert, name), getattr(ours.experts, name)
            torch.testing.assert_close(linear.weight.grad[e], ref_linear.weight.grad, **tol)
            if ref_linear.bias is not None:
                torch.testing.assert_close(linear.bias.grad[e], ref_linear.bias.grad, **tol)
