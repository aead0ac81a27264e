"""Pure-PyTorch references for the ops in this package; tests and benchmarks import these.

Legend: T routed rows, K reduction width, N output width, E experts (groups).
"""

import torch


def grouped_gemm_ref(x_TK: torch.Tensor, w: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                     trans_weight: bool = False) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ (w[e] or w[e].T), a per-expert loop in x's dtype (the reference).

    x_TK [T, K]; w [E, K, N] ([E, N, K] when trans_weight); tokens_per_expert_E [E] integers summing to at most
    T. Returns y [T, N], zeros in the unused rows past the sum (the op leaves them unspecified). Upcast the inputs
    to float64 for an exact reference.
    """
    counts = tokens_per_expert_E.tolist()
    n = w.shape[1] if trans_weight else w.shape[2]
    out = x_TK.new_zeros(x_TK.shape[0], n)
    start = 0
    for e, c in enumerate(counts):
        w_e = w[e].t() if trans_weight else w[e]
        out[start:start + c] = x_TK[start:start + c] @ w_e
        start += c
    return out


def grouped_gemm_wgrad_ref(x_TK: torch.Tensor, dy_TN: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                           trans_weight: bool = False) -> torch.Tensor:
    """dw[e] = x_e^T @ dy_e ([E, K, N]; [E, N, K] when trans_weight), exactly zero for an empty expert."""
    counts = tokens_per_expert_E.tolist()
    k, n = x_TK.shape[1], dy_TN.shape[1]
    out = x_TK.new_zeros(len(counts), k, n)
    start = 0
    for e, c in enumerate(counts):
        out[e] = x_TK[start:start + c].t() @ dy_TN[start:start + c]
        start += c
    return out.transpose(1, 2).contiguous() if trans_weight else out


def gather_rows_ref(src_TH: torch.Tensor, index_R: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``[R, H]`` in ``out_dtype``: row r is ``src_TH[index_R[r]]``, zeros where ``index_R[r] < 0``."""
    if src_TH.shape[0] == 0:  # every index is -1: nothing to read
        return src_TH.new_zeros(index_R.shape[0], src_TH.shape[1], dtype=out_dtype)
    rows = src_TH.index_select(0, index_R.clamp_min(0)).to(out_dtype)
    return torch.where((index_R >= 0).unsqueeze(1), rows, torch.zeros((), dtype=out_dtype, device=rows.device))


def gather_sum_rows_ref(src_RH: torch.Tensor, index_TK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]`` in ``out_dtype``: row t sums ``src_RH[index_TK[t, k]]`` over the slots with index >= 0, in
    slot order, accumulated in float32 (float64 for float64 sources)."""
    acc_dtype = torch.promote_types(src_RH.dtype, torch.float32)
    acc = torch.zeros(index_TK.shape[0], src_RH.shape[1], dtype=acc_dtype, device=src_RH.device)
    for k in range(index_TK.shape[1]):
        acc = acc + gather_rows_ref(src_RH, index_TK[:, k], acc_dtype)
    return acc.to(out_dtype)


def swiglu_with_probs_ref(fc1_out_RF2: torch.Tensor, probs_R: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * probs`` (``[R, 2F]`` gate half first, ``[R]``) -> ``[R, F]`` in fc1's dtype,
    computed in float32 (float64 for float64 inputs) and rounded once."""
    acc_dtype = torch.promote_types(fc1_out_RF2.dtype, torch.float32)
    gate, up = fc1_out_RF2.to(acc_dtype).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up * probs_R.to(acc_dtype).unsqueeze(-1)).to(fc1_out_RF2.dtype)


def swiglu_with_probs_backward_ref(grad_RF: torch.Tensor, fc1_out_RF2: torch.Tensor, probs_R: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dfc1 [R, 2F], dprobs [R])`` of ``swiglu_with_probs_ref`` in closed form, with ``s = sigmoid(gate)``:
    ``dgate = g * p * up * s * (1 + gate * (1 - s))``, ``dup = g * p * silu(gate)``,
    ``dprobs = sum_f g * silu(gate) * up``; float32 inside (float64 for float64 inputs)."""
    acc_dtype = torch.promote_types(fc1_out_RF2.dtype, torch.float32)
    gate, up = fc1_out_RF2.to(acc_dtype).chunk(2, dim=-1)
    grad, probs = grad_RF.to(acc_dtype), probs_R.to(acc_dtype).unsqueeze(-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgate = grad * probs * up * sig * (1 + gate * (1 - sig))
    dup = grad * probs * silu
    dprobs = (grad * silu * up).sum(dim=-1)
    return torch.cat([dgate, dup], dim=-1).to(fc1_out_RF2.dtype), dprobs.to(probs_R.dtype)
