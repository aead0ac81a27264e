"""A Megatron-style decoder-only GPT with dense or MoE MLPs (Megatron's GPTModel + TransformerLayer).

Legend: B batch, S sequence, H hidden, V vocabulary.
Pre-norm blocks: ``x + attention(RMSNorm(x))``, then ``x + mlp(RMSNorm(x))``; the MLP of layer i is an
``MoELayer`` when ``config.is_moe_layer(i)`` and a dense ``MLP`` otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.mlp import MLP
from moe_core.models.attention import SelfAttention
from moe_core.moe.moe_layer import MoELayer


class TransformerLayer(nn.Module):
    """One pre-norm block: ``input_layernorm``, ``self_attention``, ``pre_mlp_layernorm``, ``mlp``."""

    def __init__(self, config: TransformerConfig, layer_number: int, pg_collection=None):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        if config.is_moe_layer(layer_number):
            self.mlp = MoELayer(config, pg_collection)
        else:
            self.mlp = MLP(config, config.ffn_hidden_size)

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        hidden_BSH = hidden_BSH + self.self_attention(self.input_layernorm(hidden_BSH))
        return hidden_BSH + self.mlp(self.pre_mlp_layernorm(hidden_BSH))


class TransformerBlock(nn.Module):
    """The stack of layers and the final RMSNorm (Megatron's ``decoder``)."""

    def __init__(self, config: TransformerConfig, pg_collection=None):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config, i, pg_collection) for i in range(config.num_layers))
        self.final_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_BSH = layer(hidden_BSH)
        return self.final_layernorm(hidden_BSH)


class GPTModel(nn.Module):
    """Embedding -> ``decoder`` -> ``output_layer`` (tied to the embedding when configured).

    Args:
        config: ``TransformerConfig``.
        pg_collection: ``moe_core.parallel.ProcessGroupCollection`` for expert parallelism, or None.
    """

    def __init__(self, config: TransformerConfig, pg_collection=None):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=config.init_method_std)
        self.decoder = TransformerBlock(config, pg_collection)
        self.output_layer = None
        if not config.share_embeddings_and_output_weights:
            self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            nn.init.normal_(self.output_layer.weight, mean=0.0, std=config.init_method_std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``[B, S]`` int64 -> logits ``[B, S, V]`` float32, or with ``labels`` ``[B, S]`` the
        per-token cross-entropy ``[B, S]`` float32 in nats (Megatron's convention: the caller reduces it).

        Raises:
            ValueError: ``input_ids`` is not 2-D, or ``labels`` has another shape.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, S], got shape {tuple(input_ids.shape)}")
        hidden = self.decoder(self.embedding(input_ids))
        weight = self.embedding.weight if self.output_layer is None else self.output_layer.weight
        logits = F.linear(hidden, weight).float()
        if labels is None:
            return logits
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels: expected shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").reshape(labels.shape)

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers in depth order (their routers hold aux losses, loads and expert biases)."""
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def num_parameters(self, active: bool = False) -> int:
        """Parameters held by this module (shared ones once); ``active=True`` counts what one token uses.

        Active: routed experts count ``moe_router_topk / num_moe_experts`` of their parameters; everything
        else (embeddings included, as the published Qwen3 / Mixtral / OLMoE figures do) counts fully.
        """
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        cfg = self.config
        inactive = 0
        for layer in self.moe_layers():
            routed = sum(p.numel() for p in layer.experts.parameters())
            inactive += routed - routed * cfg.moe_router_topk // layer.num_local_experts
        return total - inactive

    def flops_per_token(self) -> float:
        """Training FLOPs per token: ``6 * N_active + 12 * L * Nq * D * S`` (forward + backward).

        ``N_active`` are the active parameters less the input embedding (a lookup, no FLOPs; a tied output
        layer still multiplies); the second term is attention's QK^T and AV products without causal savings.
        Source: PaLM (Chowdhery et al. 2022), appendix B; Megatron's num_floating_point_operations.
        """
        cfg = self.config
        matmul_params = self.num_parameters(active=True)
        if self.output_layer is not None:
            matmul_params -= self.embedding.weight.numel()
        attention = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.kv_channels * cfg.seq_length
        return 6.0 * matmul_params + attention


__all__ = ["GPTModel", "TransformerBlock", "TransformerLayer"]
