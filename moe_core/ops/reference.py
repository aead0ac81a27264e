"""Pure-PyTorch references for the ops in this package; tests and benchmarks import these.

Legend: T routed rows, K reduction width, N output width, E experts (groups).
"""

import torch


def grouped_gemm_ref(x_TK: torch.Tensor, w: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                     trans_weight: bool = False) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ (w[e] or w[e].T), a per-expert loop in x's dtype (the reference).

    x_TK [T, K]; w [E, K, N] ([E, N, K] when trans_weight); tokens_per_expert_E [E] integers summing to T.
    Returns y [T, N]. Upcast the inputs to float64 for an exact reference.
    """
    counts = tokens_per_expert_E.tolist()
    n = w.shape[1] if trans_weight else w.shape[2]
    out = x_TK.new_empty(x_TK.shape[0], n)
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
