"""Causal self-attention with grouped-query attention (GQA), RoPE and optional QK-norm (Megatron's SelfAttention).

Legend (docs/design.md): B batch, S sequence, H hidden, Nq query heads, Nkv key/value heads
(num_query_groups), D head dim (kv_channels).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.mlp import init_linear
from moe_core.models.document_mask import AttentionMask, masked_attention
from moe_core.models.rope import apply_rope
from moe_core.recompute import checkpoint


def qkv_row_blocks(num_heads: int, num_query_groups: int, head_dim: int) -> list[tuple[str, int, int]]:
    """Megatron's ``linear_qkv`` output layout as ``(section, start, stop)`` row blocks, in order.

    Query group g (of ``num_query_groups``) owns ``(m + 2) * D`` consecutive rows, ``m = num_heads //
    num_query_groups``: its m query heads (heads ``g * m .. g * m + m - 1``), then key head g, then value head
    g. ``section`` is ``"q"``, ``"k"`` or ``"v"``; ``start:stop`` are rows of that section in the head-major
    layout of separate q / k / v projections (Hugging Face's ``q_proj`` / ``k_proj`` / ``v_proj``). Splitting
    the rows into equal contiguous parts splits whole query groups, which is what tensor parallelism does.
    """
    m, d = num_heads // num_query_groups, head_dim
    blocks = []
    for g in range(num_query_groups):
        blocks += [("q", g * m * d, (g + 1) * m * d), ("k", g * d, (g + 1) * d), ("v", g * d, (g + 1) * d)]
    return blocks


class SelfAttention(nn.Module):
    """``linear_qkv`` (H -> (Nq + 2 Nkv) D, grouped as ``qkv_row_blocks`` describes) -> QK-norm -> RoPE ->
    causal SDPA with GQA -> ``linear_proj`` (Nq D -> H).

    Under tensor parallelism (``moe_core.models.tp_plan``) ``linear_qkv`` holds whole query groups
    and ``linear_proj`` the matching input columns; the forward reads its head counts off the tensors, so it
    runs unchanged on 1/TP of the heads.

    QK-norm (``qk_layernorm``; Megatron's ``q_layernorm`` / ``k_layernorm``), before RoPE: RMSNorm over D on
    each query and key head (``qk_layernorm_span="head"``, Qwen3), or over the whole q projection [Nq D] and
    k projection [Nkv D] before the head split (``"projection"``, OLMoE). Init: normal(0, init_method_std);
    ``linear_proj`` with std / sqrt(2 * num_layers) (Megatron's output_layer_init_method); biases
    (``add_bias_linear``) zero. Selective recompute of ``core_attn`` checkpoints the SDPA call (``moe_core.recompute``).
    With an ``attention_mask`` (``document_mask.document_causal_mask``) attention stays inside each document.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_query_groups
        self.head_dim = config.kv_channels
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_out, bias=config.add_bias_linear)
        self.linear_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)
        init_linear(self.linear_qkv, config.init_method_std)
        init_linear(self.linear_proj, config.init_method_std / math.sqrt(2 * config.num_layers))
        self.recompute_core_attn = config.recomputes("core_attn")
        self.q_layernorm = self.k_layernorm = None
        self.qk_layernorm_per_head = config.qk_layernorm_span == "head"
        if config.qk_layernorm:
            per_head = self.qk_layernorm_per_head
            q_width = self.head_dim if per_head else self.num_heads * self.head_dim
            k_width = self.head_dim if per_head else self.num_kv_heads * self.head_dim
            self.q_layernorm = nn.RMSNorm(q_width, eps=config.layernorm_epsilon)
            self.k_layernorm = nn.RMSNorm(k_width, eps=config.layernorm_epsilon)

    def forward(self, hidden_BSH: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
                attention_mask: AttentionMask | None = None) -> torch.Tensor:
        """``hidden`` ``[B, S, H]`` and ``rope_cos_sin`` (``cos``, ``sin`` ``[S, D]`` from
        ``moe_core.models.rope.rope_cos_sin``, or ``[B, 1, S, D]`` from ``rope_at``) -> ``[B, S, H]`` in hidden's
        dtype. ``attention_mask``: None (causal), or a document mask of ``document_causal_mask``."""
        batch, seq, _ = hidden_BSH.shape
        per_group, dim = self.num_heads // self.num_kv_heads, self.head_dim
        qkv_BSH3 = self.linear_qkv(hidden_BSH)
        groups = qkv_BSH3.shape[-1] // ((per_group + 2) * dim)  # G query groups (here), also for an empty batch
        qkv_BSGXD = qkv_BSH3.view(batch, seq, groups, per_group + 2, dim)
        q_BSND = qkv_BSGXD[:, :, :, :per_group].reshape(batch, seq, groups * per_group, dim)
        k_BSND, v_BSND = qkv_BSGXD[:, :, :, per_group], qkv_BSGXD[:, :, :, per_group + 1]
        if self.q_layernorm is not None and not self.qk_layernorm_per_head:
            q_BSND = self.q_layernorm(q_BSND.flatten(2)).view_as(q_BSND)
            k_BSND = self.k_layernorm(k_BSND.flatten(2)).view_as(k_BSND)
        q_BNSD, k_BNSD, v_BNSD = q_BSND.transpose(1, 2), k_BSND.transpose(1, 2), v_BSND.transpose(1, 2)
        if self.q_layernorm is not None and self.qk_layernorm_per_head:
            q_BNSD, k_BNSD = self.q_layernorm(q_BNSD), self.k_layernorm(k_BNSD)
        cos, sin = rope_cos_sin
        q_BNSD, k_BNSD = apply_rope(q_BNSD, cos, sin), apply_rope(k_BNSD, cos, sin)
        core_attn = functools.partial(F.scaled_dot_product_attention, is_causal=True, enable_gqa=per_group > 1)
        args = (q_BNSD, k_BNSD, v_BNSD)
        if attention_mask is not None:
            core_attn = functools.partial(masked_attention, enable_gqa=per_group > 1)
            args += (attention_mask,)
        out_BNSD = checkpoint(core_attn, *args) if self.recompute_core_attn else core_attn(*args)
        return self.linear_proj(out_BNSD.transpose(1, 2).reshape(batch, seq, groups * per_group * dim))


__all__ = ["SelfAttention", "qkv_row_blocks"]
