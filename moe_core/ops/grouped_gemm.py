"""TEMPORARY stub (the ops work replaces this file): same signature, pure-PyTorch implementation."""

import torch

from moe_core.ops.reference import grouped_gemm_ref


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, *,
                 trans_weight: bool = False) -> torch.Tensor:
    return grouped_gemm_ref(x, weight, tokens_per_expert, trans_weight) if x.shape[0] else x.new_zeros(0, weight.shape[1] if trans_weight else weight.shape[2]) + 0 * weight.sum()
