"""SwiGLU with the routing probs folded in, forward and backward in one pass each (float32 arithmetic).

Legend: R rows, F expert ffn width; fc1's output is ``[R, 2F]``, gate half first.
Forward ``h = silu(g) * u * p``; backward, with ``s = sigmoid(g)``:
``dg = dh * p * u * s * (1 + g * (1 - s))``, ``du = dh * p * silu(g)``, ``dp = sum_f dh * silu(g) * u``.
"""

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from moe_core.ops.triton import plain

_BLOCK_F = 1024


@triton.jit
def _live(row, used_ptr, LIMIT: tl.constexpr):
    # Whether the row is below the used rows' count (every row without a limit).
    if LIMIT:
        return row < tl.load(used_ptr)
    return row >= 0


@triton.jit
def _swiglu_probs_fwd_kernel(fc1_ptr, probs_ptr, used_ptr, out_ptr, F, BLOCK_F: tl.constexpr, LIMIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (cols < F) & _live(row, used_ptr, LIMIT)
    gate = tl.load(fc1_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(fc1_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    prob = tl.load(probs_ptr + row).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up * prob
    tl.store(out_ptr + row * F + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_probs_bwd_kernel(grad_ptr, fc1_ptr, probs_ptr, used_ptr, dfc1_ptr, dprobs_ptr, F,
                             BLOCK_F: tl.constexpr, LIMIT: tl.constexpr):
    # One program per row: the probs gradient is a reduction over the row's F columns.
    row = tl.program_id(0).to(tl.int64)
    live = _live(row, used_ptr, LIMIT)
    prob = tl.load(probs_ptr + row).to(tl.float32)
    dprob = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for start in range(0, F, BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)
        mask = (cols < F) & live
        grad = tl.load(grad_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(fc1_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(fc1_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dgate = grad * prob * up * sig * (1.0 + gate * (1.0 - sig))
        dup = grad * prob * silu
        tl.store(dfc1_ptr + row * 2 * F + cols, dgate.to(dfc1_ptr.dtype.element_ty), mask=mask)
        tl.store(dfc1_ptr + row * 2 * F + F + cols, dup.to(dfc1_ptr.dtype.element_ty), mask=mask)
        dprob += grad * silu * up
    tl.store(dprobs_ptr + row, tl.sum(dprob, axis=0).to(dprobs_ptr.dtype.element_ty), mask=live)


def _block(f: int) -> int:
    return min(_BLOCK_F, triton.next_power_of_2(max(f, 16)))


def swiglu_probs_fwd(fc1_out: torch.Tensor, probs: torch.Tensor, used_rows: torch.Tensor | None) -> torch.Tensor:
    """``fc1_out`` ``[R, 2F]`` contiguous, ``probs`` ``[R]``, ``used_rows`` a 0-dim int64 or None -> ``[R, F]`` in
    fc1_out's dtype, its rows at or past ``used_rows`` unwritten."""
    rows, f = fc1_out.shape[0], fc1_out.shape[1] // 2
    out = torch.empty(rows, f, dtype=fc1_out.dtype, device=fc1_out.device)
    if rows and f:
        block = _block(f)
        kernel = _swiglu_probs_fwd_kernel if plain(fc1_out, out) else wrap_triton(_swiglu_probs_fwd_kernel)
        kernel[(rows, triton.cdiv(f, block))](fc1_out, probs, probs if used_rows is None else used_rows, out, f,
                                              BLOCK_F=block, LIMIT=used_rows is not None, num_warps=4)
    return out


def swiglu_probs_bwd(grad: torch.Tensor, fc1_out: torch.Tensor, probs: torch.Tensor, used_rows: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dfc1 [R, 2F] in fc1_out's dtype, dprobs [R] in probs' dtype)`` from ``grad`` ``[R, F]``, their rows at or
    past ``used_rows`` unwritten."""
    rows, f = fc1_out.shape[0], fc1_out.shape[1] // 2
    dfc1 = torch.empty_like(fc1_out)
    dprobs = torch.empty_like(probs)
    if rows:
        if f:
            kernel = _swiglu_probs_bwd_kernel if plain(fc1_out, dfc1) else wrap_triton(_swiglu_probs_bwd_kernel)
            kernel[(rows,)](grad, fc1_out, probs, probs if used_rows is None else used_rows, dfc1, dprobs, f,
                            BLOCK_F=_block(f), LIMIT=used_rows is not None, num_warps=4)
        else:
            dprobs.zero_()
    return dfc1, dprobs
