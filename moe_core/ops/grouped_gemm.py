"""The grouped GEMM op: argument checks, fake kernels and autograd around ``torch.ops.moe_core.*``.

Legend: T routed rows (expert-major), K reduction width, N output width, E experts.

Layers (as in tgale96/grouped_gemm): the C++/CUDA kernels in ``csrc/`` compute one product each;
``grouped_gemm`` checks its arguments and calls the custom op; autograd (C++, ``csrc/autograd.cpp``) reuses
the same kernels, the forward one with the weight transposed for dgrad and ``grouped_gemm_wgrad`` for wgrad.
Under autocast with a float32 weight that requires grad, the Autocast kernel (``csrc/autocast.cpp``) computes
the weight's gradient in float32 with ``grouped_gemm_wgrad_fp32``.
Fake kernels make the ops traceable by ``torch.compile(fullgraph=True)``. The wgrad ops have their own autograd, in
C++ too (``csrc/autograd.cpp``), so gradients of gradients (double backward) are exact.
"""

from __future__ import annotations

import torch

import moe_core._C  # noqa: F401  (registers torch.ops.moe_core.*)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_COUNT_DTYPES = (torch.int32, torch.int64)


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, *,
                 trans_weight: bool = False, gradient_accumulation_fusion: bool = False) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ weight[e]`` for every expert e, in one call.

    Args:
        x: ``[T, K]`` float32, bfloat16, float16 (or float64, for references); rows grouped by expert.
        weight: ``[E, K, N]``, or ``[E, N, K]`` with ``trans_weight`` (then ``weight[e]^T`` is used); x's dtype
            and device.
        tokens_per_expert: ``[E]`` int32/int64 on any device, rows of each expert, summing to at most T. Zeros
            are fine anywhere (all zero, T == 0). Rows past the sum are unused (a static bound on the rows, as
            in a sync-free dispatch): never read, left unwritten in y and in dgrad (whatever memory held, as
            ``torch._grouped_mm`` leaves them), no part of any weight gradient.
        trans_weight: see ``weight``.
        gradient_accumulation_fusion: Megatron's fusion: when ``weight`` carries a float32 ``main_grad``
            of its shape, backward adds the weight gradient into ``weight.main_grad`` and hands autograd a zero
            gradient (so the weight's hooks still fire), setting ``weight.grad_added_to_main_grad = True``.
    Returns:
        ``[T, N]`` in x's dtype; bf16/fp16 accumulate in float32. The rows past the counts' sum are unspecified.
    Backward:
        dgrad ``dx = grouped_gemm(dy, weight, trans_weight=not trans_weight)``; wgrad ``dweight[e] = x_e^T dy_e``,
        exactly zero for an expert without rows and never None, also when T == 0.
    Raises:
        TypeError: a non-tensor argument, float counts, unsupported or mismatched dtypes.
        ValueError: wrong ranks, K or E mismatch, device mismatch, negative counts or counts summing past T.
            The counts' values are checked only when they live on the CPU: reading GPU counts would sync.
    """
    check_grouped_gemm_args(x, weight, tokens_per_expert, trans_weight)
    counts = tokens_per_expert if tokens_per_expert.device == x.device else tokens_per_expert.to(x.device)
    if gradient_accumulation_fusion:
        return _GroupedGemmMainGrad.apply(x, weight, counts, trans_weight)
    return torch.ops.moe_core.grouped_gemm(x, weight, counts, trans_weight)


def check_grouped_gemm_args(x, weight, tokens_per_expert, trans_weight: bool) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument when the inputs break the op's contract."""
    for name, value in (("x", x), ("weight", weight), ("tokens_per_expert", tokens_per_expert)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, K], got shape {tuple(x.shape)}")
    if weight.dim() != 3:
        raise ValueError(
            f"weight: expected [E, K, N] (or [E, N, K] with trans_weight), got shape {tuple(weight.shape)}")
    if tokens_per_expert.dim() != 1:
        raise ValueError(f"tokens_per_expert: expected [E], got shape {tuple(tokens_per_expert.shape)}")
    if tokens_per_expert.dtype not in _COUNT_DTYPES:
        raise TypeError(f"tokens_per_expert: expected int32 or int64, got {tokens_per_expert.dtype}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x: expected one of {_FLOAT_DTYPES}, got {x.dtype}")
    if weight.dtype != x.dtype and not _autocast_casts_both(x, weight):
        raise TypeError(f"weight: expected x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected x's device {x.device}, got {weight.device}")
    k = weight.shape[2] if trans_weight else weight.shape[1]
    if x.shape[1] != k:
        raise ValueError(
            f"x: expected K = {k} columns to match weight {tuple(weight.shape)} (trans_weight={trans_weight}), "
            f"got {x.shape[1]}"
        )
    if tokens_per_expert.shape[0] != weight.shape[0]:
        raise ValueError(f"tokens_per_expert: expected E = {weight.shape[0]} entries (weight's E), "
                         f"got {tokens_per_expert.shape[0]}")
    if tokens_per_expert.device.type == "cpu" and not _is_tracing():
        if bool((tokens_per_expert < 0).any()):
            raise ValueError(f"tokens_per_expert: expected non-negative counts, got {tokens_per_expert.tolist()}")
        # Each count bounded by T first: counts near 2^63 could wrap their int64 sum around to T.
        if tokens_per_expert.numel() and int(tokens_per_expert.max()) > x.shape[0]:
            raise ValueError(f"tokens_per_expert: a count exceeds T = {x.shape[0]} (x's rows), got "
                             f"{tokens_per_expert.tolist()}")
        total = int(tokens_per_expert.sum())
        if total > x.shape[0]:
            raise ValueError(f"tokens_per_expert: counts sum to {total}, expected at most T = {x.shape[0]} (x's "
                             "rows)")


def _autocast_casts_both(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inside torch.autocast the op's Autocast kernel (csrc/autocast.cpp) casts float32/16-bit x and weight to
    one dtype, so they may differ here."""
    eligible = (torch.float32, torch.bfloat16, torch.float16)
    return torch.is_autocast_enabled(x.device.type) and x.dtype in eligible and weight.dtype in eligible


def _is_tracing() -> bool:
    return torch.compiler.is_compiling()


@torch.library.register_fake("moe_core::grouped_gemm")
def _grouped_gemm_fake(x, weight, tokens_per_expert, trans_weight):
    n = weight.shape[1] if trans_weight else weight.shape[2]
    return x.new_empty(x.shape[0], n)


@torch.library.register_fake("moe_core::grouped_gemm_wgrad")
def _grouped_gemm_wgrad_fake(x, dy, tokens_per_expert, trans_weight):
    e, k, n = tokens_per_expert.shape[0], x.shape[1], dy.shape[1]
    return x.new_empty(e, n, k) if trans_weight else x.new_empty(e, k, n)


@torch.library.register_fake("moe_core::grouped_gemm_wgrad_fp32")
def _grouped_gemm_wgrad_fp32_fake(x, dy, tokens_per_expert, trans_weight):
    return _grouped_gemm_wgrad_fake(x, dy, tokens_per_expert, trans_weight).float()


@torch.library.register_fake("moe_core::grouped_gemm_wgrad_accum_")
def _grouped_gemm_wgrad_accum_fake(main_grad, x, dy, tokens_per_expert, trans_weight):
    return None


# Autograd of moe_core::grouped_gemm and of its wgrads (their double backward) lives in C++ (csrc/autograd.cpp): a
# Python autograd kernel would add host time to every call (docs/kernels.md).


class _GroupedGemmMainGrad(torch.autograd.Function):
    """grouped_gemm whose wgrad accumulates into ``weight.main_grad`` (Megatron's gradient_accumulation_fusion)."""

    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, trans_weight):
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None or main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
            raise ValueError(
                "weight.main_grad: gradient_accumulation_fusion needs a float32 main_grad of shape "
                f"{tuple(weight.shape)}, got {None if main_grad is None else (main_grad.dtype, tuple(main_grad.shape))}"
            )
        ctx.save_for_backward(x, weight, tokens_per_expert)
        ctx.trans_weight = trans_weight
        return torch.ops.moe_core.grouped_gemm(x, weight, tokens_per_expert, trans_weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, tokens_per_expert = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dx = torch.ops.moe_core.grouped_gemm(grad_out, weight, tokens_per_expert, not ctx.trans_weight)
        torch.ops.moe_core.grouped_gemm_wgrad_accum_(weight.main_grad, x, grad_out, tokens_per_expert, ctx.trans_weight)
        weight.grad_added_to_main_grad = True
        return dx, torch.zeros_like(weight), None, None


__all__ = ["grouped_gemm", "check_grouped_gemm_args"]
