"""Causal self-attention with grouped-query attention (GQA), RoPE and optional QK-norm (Megatron's SelfAttention).

Legend (docs/design.md): B batch, S sequence, H hidden, Nq query heads, Nkv key/value heads
(num_query_groups), D head dim (kv_channels).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.mlp import init_linear
from moe_core.models.rope import apply_rope


class SelfAttention(nn.Module):
    """``linear_qkv`` (H -> (Nq + 2 Nkv) D, q then k then v) -> QK-norm -> RoPE -> causal SDPA with GQA ->
    ``linear_proj`` (Nq D -> H).

    QK-norm (``qk_layernorm``; Megatron's ``q_layernorm`` / ``k_layernorm``), before RoPE: RMSNorm over D on
    each query and key head (``qk_layernorm_span="head"``, Qwen3), or over the whole q projection [Nq D] and
    k projection [Nkv D] before the head split (``"projection"``, OLMoE). Init: normal(0, init_method_std);
    ``linear_proj`` with std / sqrt(2 * num_layers) (Megatron's output_layer_init_method); biases
    (``add_bias_linear``) zero.
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
        self.q_layernorm = self.k_layernorm = None
        self.qk_layernorm_per_head = config.qk_layernorm_span == "head"
        if config.qk_layernorm:
            per_head = self.qk_layernorm_per_head
            q_width = self.head_dim if per_head else self.num_heads * self.head_dim
            k_width = self.head_dim if per_head else self.num_kv_heads * self.head_dim
            self.q_layernorm = nn.RMSNorm(q_width, eps=config.layernorm_epsilon)
            self.k_layernorm = nn.RMSNorm(k_width, eps=config.layernorm_epsilon)

    def forward(self, hidden_BSH: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``hidden`` ``[B, S, H]`` and ``rope_cos_sin`` (``cos``, ``sin`` ``[S, D]`` from
        ``moe_core.models.rope.rope_cos_sin``) -> ``[B, S, H]`` in hidden's dtype."""
        batch, seq, _ = hidden_BSH.shape
        q, k, v = self.linear_qkv(hidden_BSH).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
            dim=-1,
        )
        if self.q_layernorm is not None and not self.qk_layernorm_per_head:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q_BNSD = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k_BNSD = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BNSD = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_layernorm is not None and self.qk_layernorm_per_head:
            q_BNSD, k_BNSD = self.q_layernorm(q_BNSD), self.k_layernorm(k_BNSD)
        cos, sin = rope_cos_sin
        q_BNSD, k_BNSD = apply_rope(q_BNSD, cos, sin), apply_rope(k_BNSD, cos, sin)
        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD, k_BNSD, v_BNSD, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.linear_proj(out_BNSD.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


__all__ = ["SelfAttention"]
