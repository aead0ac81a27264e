"""A torch-native MoE layer of torchtitan's design: the peer that tools/bench_moe_layer.py and
tools/bench_pretrain.py measure moe_core against.

Legend: T tokens, H hidden, F expert ffn width, E experts, K top-k, R = T * K routed rows (expert-major).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def masked_grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` as a per-expert loop: every expert's product over all R rows,
    each row keeping its own expert's (the others are multiplied by exactly 0).

    E times the FLOPs of the grouped GEMM, static shapes (so ``torch.compile(fullgraph=True)`` traces it), any
    float dtype: the CPU stand-in of ``NativeMoE``. Rows of expert e are ``[offs[e - 1], offs[e])``, offs ``[E]`` int.
    """
    rows = torch.arange(x_RK.shape[0], device=x_RK.device, dtype=offs.dtype)
    expert_R = torch.searchsorted(offs, rows, right=True)
    out = x_RK.new_zeros(x_RK.shape[0], w_EKN.shape[2])
    for e in range(w_EKN.shape[0]):
        out = out + (expert_R == e).unsqueeze(-1).to(x_RK.dtype) * (x_RK @ w_EKN[e])
    return out


class NativeMoE(nn.Module):
    """Token-choice top-K MoE with SwiGLU experts, in plain PyTorch: torchtitan's design
    (torchtitan/models/moe: ``TokenChoiceTopKRouter``, ``GroupedExperts`` with ``torch._grouped_mm``).

    Router: an fp32 linear (autocast off; float64 input keeps float64), softmax over the E experts, top-K, the
    K probs renormalised to sum to 1 (Qwen3's ``norm_topk_prob``) and given in float32. Permute: a stable
    argsort of the flat ``[T * K]`` expert ids (rows expert-major, token order inside an expert). Experts:
    ``silu(x_R @ w1_gate[e]) * (x_R @ w1_up[e]) @ w2[e]`` as two grouped GEMMs with ``offs = cumsum(counts)``
    int32, in x's dtype (the autocast dtype under autocast); each output row times its prob; ``index_add_``
    sums each token's K rows.

    This is the function of moe_core's ``MoELayer`` with the softmax router and ``moe_router_pre_softmax``
    False (top-K, then softmax over the K, equals softmax over E, top-K, renormalise), SwiGLU, no bias, no
    shared expert, no capacity: ``from_moe_layer`` takes its weights.

    Args:
        router_weight: ``[E, H]``; w1: ``[E, H, 2F]`` (gate half first); w2: ``[E, F, H]`` (moe_core's
            ``GroupedMLP`` layout). Registered as parameters as given (an ``nn.Parameter`` stays shared).
        topk: K.
        grouped_mm: True: ``torch._grouped_mm`` (CUDA: bf16; the CPU kernel takes float32 / bf16 only);
            False: ``masked_grouped_mm``; None: ``torch._grouped_mm`` on CUDA, ``masked_grouped_mm`` elsewhere
            (torch 2.13's CPU ``_grouped_mm`` has no float64 kernel and its backward rejects stride-0 grads).
    Raises:
        ValueError: shapes disagree or topk is outside [1, E].
    """

    def __init__(self, router_weight: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk: int,
                 grouped_mm: bool | None = None):
        super().__init__()
        e, h = router_weight.shape
        if w1.dim() != 3 or w1.shape[:2] != (e, h) or w1.shape[2] % 2:
            raise ValueError(f"w1: expected [E={e}, H={h}, 2F], got {tuple(w1.shape)}")
        if w2.shape != (e, w1.shape[2] // 2, h):
            raise ValueError(f"w2: expected [{e}, {w1.shape[2] // 2}, {h}], got {tuple(w2.shape)}")
        if not 1 <= topk <= e:
            raise ValueError(f"topk: expected 1..{e}, got {topk}")
        self.router_weight, self.w1, self.w2 = (t if isinstance(t, nn.Parameter) else nn.Parameter(t)
                                                for t in (router_weight, w1, w2))
        self.topk = topk
        self.grouped_mm = grouped_mm

    @classmethod
    def from_moe_layer(cls, layer: nn.Module, grouped_mm: bool | None = None) -> NativeMoE:
        """Share the parameters of a moe_core ``MoELayer`` with ``GroupedMLP`` experts.

        Raises:
            ValueError: the layer's config computes another function (see the class docstring).
        """
        cfg = layer.config
        unsupported = {
            "moe_router_score_function": cfg.moe_router_score_function != "softmax",
            "moe_router_pre_softmax": cfg.moe_router_pre_softmax,
            "activation_func": cfg.activation_func != "swiglu",
            "add_bias_linear": cfg.add_bias_linear,
            "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size is not None,
            "moe_expert_capacity_factor": cfg.moe_expert_capacity_factor is not None,
            "moe_router_topk_scaling_factor": cfg.moe_router_topk_scaling_factor is not None,
            "moe_router_num_groups": cfg.moe_router_num_groups is not None,
            "moe_router_enable_expert_bias": cfg.moe_router_enable_expert_bias,
            "moe_grouped_gemm": not cfg.moe_grouped_gemm,
        }
        bad = [name for name, is_bad in unsupported.items() if is_bad]
        if bad:
            raise ValueError(f"layer.config: NativeMoE computes the plain softmax top-k SwiGLU layer; these fields "
                             f"differ from it: {bad}")
        return cls(layer.router.weight, layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight,
                   cfg.moe_router_topk, grouped_mm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> the same shape, in x's dtype (under autocast: the autocast dtype)."""
        x_TH = x.reshape(-1, x.shape[-1])
        num_tokens, num_experts = x_TH.shape[0], self.router_weight.shape[0]
        router_dtype = torch.promote_types(x_TH.dtype, torch.float32)
        with torch.autocast(x_TH.device.type, enabled=False):
            logits_TE = F.linear(x_TH.to(router_dtype), self.router_weight.to(router_dtype))
        top_probs_TK, top_ids_TK = torch.softmax(logits_TE, dim=-1).topk(self.topk, dim=-1)
        top_probs_TK = (top_probs_TK / top_probs_TK.sum(dim=-1, keepdim=True)).float()
        ids_R = top_ids_TK.reshape(-1)
        order_R = ids_R.argsort(stable=True)
        token_R = order_R // self.topk
        counts_E = ids_R.new_zeros(num_experts).scatter_add_(0, ids_R, torch.ones_like(ids_R))
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        use_grouped_mm = self.grouped_mm if self.grouped_mm is not None else x_TH.is_cuda
        gmm = torch._grouped_mm if use_grouped_mm else masked_grouped_mm
        # Autocast does not cover _grouped_mm: the experts run in its dtype by hand, as its linears would.
        device_type = x_TH.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_TH.dtype
        x_RH = x_TH.to(dtype)[token_R]
        gate_RF, up_RF = gmm(x_RH, self.w1.to(dtype), offs=offs_E).chunk(2, dim=-1)
        y_RH = gmm(F.silu(gate_RF) * up_RF, self.w2.to(dtype), offs=offs_E)
        y_RH = (y_RH * top_probs_TK.reshape(-1)[order_R].unsqueeze(-1)).to(dtype)  # in the wider dtype
        out_TH = y_RH.new_zeros(num_tokens, y_RH.shape[1]).index_add_(0, token_R, y_RH)
        return out_TH.view(x.shape)


__all__ = ["NativeMoE", "masked_grouped_mm"]
