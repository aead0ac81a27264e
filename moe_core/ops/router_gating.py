"""The router's logits GEMM in its own dtype (Megatron's ``router_gating_linear``):
``torch.ops.moe_core.router_gating_linear``.

Legend: T tokens, H hidden, E experts.

``x_TH @ weight_EH.t()`` computed in ``dtype`` (float32 or float64) with autocast off, forward and backward. The
op saves x and the weight as they come and its backward remakes their ``dtype`` copies, so a 16-bit x keeps no
float32 copy (T x H x 4 bytes) alive from forward to backward. Ops rather than tensor code because
torch.compile's partitioner would save the copy anyway: it keeps a cast whose consumer is a GEMM on the forward
side, while the copies inside an op are out of its reach.
"""

from __future__ import annotations

import torch

from moe_core.ops.eager import EagerOp


def _router_gating_linear(x_TH: torch.Tensor, weight_EH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(x_TH.device.type, enabled=False):
        return x_TH.to(dtype) @ weight_EH.to(dtype).t()


def _router_gating_linear_backward(grad_TE: torch.Tensor, x_TH: torch.Tensor, weight_EH: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = grad_TE.dtype
    with torch.autocast(x_TH.device.type, enabled=False):
        grad_x = (grad_TE @ weight_EH.to(dtype)).to(x_TH.dtype)
        grad_w = (grad_TE.t() @ x_TH.to(dtype)).to(weight_EH.dtype)
    return grad_x, grad_w


_op = torch.library.custom_op("moe_core::router_gating_linear", _router_gating_linear, mutates_args=())
_backward_op = torch.library.custom_op("moe_core::router_gating_linear_backward", _router_gating_linear_backward,
                                       mutates_args=())


@_op.register_fake
def _(x_TH, weight_EH, dtype):
    return x_TH.new_empty((x_TH.shape[0], weight_EH.shape[0]), dtype=dtype)


@_backward_op.register_fake
def _(grad_TE, x_TH, weight_EH):
    return torch.empty_like(x_TH), torch.empty_like(weight_EH)


def _setup(ctx, inputs, output):
    x_TH, weight_EH, dtype = inputs
    ctx.save_for_backward(x_TH, weight_EH)
    ctx.dtype = dtype


def _backward(ctx, grad_TE):
    x_TH, weight_EH = ctx.saved_tensors
    grad_x, grad_w = _BACKWARD(grad_TE.to(ctx.dtype), x_TH, weight_EH)
    return grad_x, grad_w, None


_op.register_autograd(_backward, setup_context=_setup)
_FORWARD = EagerOp(torch.ops.moe_core.router_gating_linear, _router_gating_linear, _setup, _backward)
_BACKWARD = EagerOp(torch.ops.moe_core.router_gating_linear_backward, _router_gating_linear_backward)


def router_gating_linear(x_TH: torch.Tensor, weight_EH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The router's logits ``x_TH @ weight_EH.t()`` in ``dtype``, whatever autocast is doing.

    Args:
        x_TH: ``[T, H]`` float, any float dtype. weight_EH: ``[E, H]`` float. dtype: torch.float32 or
            torch.float64, the GEMM's and the result's dtype.
    Returns:
        ``[T, E]`` in ``dtype``. Gradients flow back to x and the weight in their own dtypes.
    Raises:
        ValueError: shapes do not fit. TypeError: ``dtype`` is not float32 or float64.
    """
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    if x_TH.dim() != 2 or weight_EH.dim() != 2 or x_TH.shape[1] != weight_EH.shape[1]:
        raise ValueError(f"x_TH / weight_EH: expected [T, H] and [E, H], got {tuple(x_TH.shape)} and "
                         f"{tuple(weight_EH.shape)}")
    return _FORWARD(x_TH, weight_EH, dtype)


__all__ = ["router_gating_linear"]
