"""Causal self-attention with grouped-query attention (GQA), RoPE and optional QK-norm (Megatron's SelfAttention).

Legend: B batch, S sequence, H hidden, Nq query heads, Nkv key/value heads (num_query_groups), D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.mlp import init_linear
from moe_core.models.rope import apply_rope, rope_cos_sin


class SelfAttention(nn.Module):
    """``linear_qkv`` (H -> (Nq + 2 Nkv) D) -> RoPE -> causal SDPA with GQA -> ``linear_proj`` (Nq D -> H).

    QK-norm (``qk_layernorm``, Qwen3 / OLMoE): RMSNorm over D on each query and key head before RoPE.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_query_groups
        self.head_dim = config.kv_channels
        self.rotary_base = config.rotary_base
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_out, bias=config.add_bias_linear)
        self.linear_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)
        init_linear(self.linear_qkv, config.init_method_std)
        init_linear(self.linear_proj, config.init_method_std / math.sqrt(2 * config.num_layers))
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = nn.RMSNorm(self.head_dim, eps=config.layernorm_epsilon)
            self.k_layernorm = nn.RMSNorm(self.head_dim, eps=config.layernorm_epsilon)

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = hidden_BSH.shape
        qkv = self.linear_qkv(hidden_BSH)
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        cos, sin = rope_cos_sin(seq, self.head_dim, self.rotary_base, hidden_BSH.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.linear_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


__all__ = ["SelfAttention"]
