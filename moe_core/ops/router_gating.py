"""The router's logits GEMM in its own dtype (Megatron's ``router_gating_linear``):
``torch.ops.moe_core.router_gating_linear``, a C++ op (``csrc/router_gating.cpp``: forward, backward, autograd;
its backward an op too, with its own autograd for double backward).

Legend: T tokens, H hidden, E experts.

``x_TH @ weight_EH.t()`` computed in ``dtype`` (float32 or float64) with autocast off, forward and backward. The
op saves x and the weight as they come and its backward remakes their ``dtype`` copies, so a 16-bit x keeps no
float32 copy (T x H x 4 bytes) alive from forward to backward. An op rather than tensor code because
torch.compile's partitioner would save the copy anyway: it keeps a cast whose consumer is a GEMM on the forward
side, while the copies inside an op are out of its reach. The backward is an op for the same reason: as ATen ops,
Inductor may make x's copy at the start of the layer's backward and hold it through the expert GEMMs. In C++
because a compiled layer calls it on every step: a Python op's dispatch costs host time where small layers are
host-bound.
"""

from __future__ import annotations

import torch

import moe_core._C  # noqa: F401  (registers torch.ops.moe_core.*)


@torch.library.register_fake("moe_core::router_gating_linear")
def _(x_TH, weight_EH, dtype):
    return x_TH.new_empty((x_TH.shape[0], weight_EH.shape[0]), dtype=dtype)


@torch.library.register_fake("moe_core::router_gating_linear_backward")
def _(grad_TE, x_TH, weight_EH, output_mask):
    return (x_TH.new_empty(x_TH.shape) if output_mask[0] else None,
            weight_EH.new_empty(weight_EH.shape) if output_mask[1] else None)


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
    return torch.ops.moe_core.router_gating_linear(x_TH, weight_EH, dtype)


__all__ = ["router_gating_linear"]
