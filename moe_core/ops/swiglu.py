"""SwiGLU with the routing probs folded in (Megatron's ``activation_func_with_probs`` for swiglu), forward
and backward each one pass: ``torch.ops.moe_core.swiglu_with_probs``.

Legend: R routed rows, F expert ffn width.

On CUDA the passes are Triton kernels (``ops/triton/swiglu.py``); elsewhere the PyTorch references
``swiglu_with_probs_ref`` and ``swiglu_with_probs_backward_ref``.
"""

from __future__ import annotations

import torch

from moe_core.ops.eager import EagerOp
from moe_core.ops.reference import swiglu_with_probs_backward_ref, swiglu_with_probs_ref
from moe_core.ops.triton_available import triton_available


def _use_triton(fc1_out: torch.Tensor) -> bool:
    return fc1_out.is_cuda and triton_available()


# used_rows: a 0-dim int64 on fc1_out's device or None; the Triton kernels skip the rows at or past it, the
# references compute every row.
def _swiglu_with_probs(fc1_out: torch.Tensor, probs: torch.Tensor, used_rows: torch.Tensor | None = None
                       ) -> torch.Tensor:
    if _use_triton(fc1_out):
        from moe_core.ops.triton.swiglu import swiglu_probs_fwd

        return swiglu_probs_fwd(fc1_out.contiguous(), probs.contiguous(), used_rows)
    return swiglu_with_probs_ref(fc1_out, probs)


def _swiglu_with_probs_backward(grad: torch.Tensor, fc1_out: torch.Tensor, probs: torch.Tensor,
                                used_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(fc1_out):
        from moe_core.ops.triton.swiglu import swiglu_probs_bwd

        return swiglu_probs_bwd(grad.contiguous(), fc1_out.contiguous(), probs.contiguous(), used_rows)
    return swiglu_with_probs_backward_ref(grad, fc1_out, probs)


# triton_op: the implementation is also the fake kernel, and compilation traces into it (ops/triton/__init__.py).
_swiglu_op = torch.library.triton_op("moe_core::swiglu_with_probs", _swiglu_with_probs, mutates_args=())
_swiglu_backward_op = torch.library.triton_op("moe_core::swiglu_with_probs_backward", _swiglu_with_probs_backward,
                                              mutates_args=())


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    fc1_out, probs, used_rows = ctx.saved_tensors
    return *_SWIGLU_BACKWARD(grad, fc1_out, probs, used_rows), None


@torch.autograd.function.once_differentiable
def _double_backward(ctx, grad_dfc1, grad_dprobs):
    """The backward pass's own gradients (double backward): autograd through its reference formula."""
    grad, fc1_out, probs, _ = ctx.saved_tensors
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (grad, fc1_out, probs)]
        outputs = swiglu_with_probs_backward_ref(*inputs)
        grads = torch.autograd.grad(outputs, inputs, (grad_dfc1, grad_dprobs), allow_unused=True,
                                    materialize_grads=True)
    return *grads, None


_swiglu_op.register_autograd(_backward, setup_context=_setup)
_swiglu_backward_op.register_autograd(_double_backward, setup_context=_setup)
_SWIGLU = EagerOp(torch.ops.moe_core.swiglu_with_probs, _swiglu_with_probs, _setup, _backward)
_SWIGLU_BACKWARD = EagerOp(torch.ops.moe_core.swiglu_with_probs_backward, _swiglu_with_probs_backward, _setup,
                           _double_backward)


def swiglu_with_probs(fc1_out_RF2: torch.Tensor, probs_R: torch.Tensor, used_rows: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``silu(gate) * up * probs`` per row, computed in float32 and rounded once to fc1's dtype.

    Args:
        fc1_out_RF2: ``[R, 2F]`` float, gate half first (Megatron's order). probs_R: ``[R]`` float.
        used_rows: a 0-dim integer tensor (copied to fc1's device), or None (every row used): the rows at or past it are
            unused (a static bound's, as the grouped GEMM's rows past ``tokens_per_expert``'s sum), never read,
            their outputs and gradients unspecified (unwritten on CUDA).
    Returns:
        ``[R, F]`` in fc1_out's dtype. Differentiable in ``fc1_out_RF2`` and ``probs_R`` (``probs_R`` gets
        ``sum_f grad * silu(gate) * up``).
    Raises:
        ValueError: shapes do not fit. TypeError: ``used_rows`` is not a 0-dim integer tensor.
    """
    if fc1_out_RF2.dim() != 2 or fc1_out_RF2.shape[1] % 2:
        raise ValueError(f"fc1_out_RF2: expected [R, 2F], got {tuple(fc1_out_RF2.shape)}")
    if probs_R.shape != fc1_out_RF2.shape[:1]:
        raise ValueError(f"probs_R: expected [{fc1_out_RF2.shape[0]}], got {tuple(probs_R.shape)}")
    if used_rows is not None:
        if (not isinstance(used_rows, torch.Tensor) or used_rows.dim() or used_rows.is_floating_point()
                or used_rows.is_complex() or used_rows.dtype == torch.bool):
            raise TypeError(f"used_rows: expected a 0-dim integer tensor or None, got {_describe(used_rows)}")
        used_rows = used_rows.to(fc1_out_RF2.device, torch.int64)
    return _SWIGLU(fc1_out_RF2, probs_R, used_rows)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-dim {value.dtype} tensor"
    return type(value).__name__


__all__ = ["swiglu_with_probs"]
