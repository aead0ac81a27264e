"""Pre-norm transformer layers and their stack (Megatron's ``TransformerLayer`` and ``TransformerBlock``).

Legend (docs/design.md): B batch, S sequence, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.mlp import MLP
from moe_core.models.attention import SelfAttention
from moe_core.models.rope import rope_cos_sin
from moe_core.moe.moe_layer import MoELayer
from moe_core.parallel.process_groups import ProcessGroupCollection


class TransformerLayer(nn.Module):
    """``x + self_attention(input_layernorm(x))``, then ``x + mlp(pre_mlp_layernorm(x))``.

    ``mlp`` is an ``MoELayer`` when ``config.is_moe_layer(layer_number)`` (0-based), else a dense ``MLP`` of
    width ``ffn_hidden_size``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        if config.is_moe_layer(layer_number):
            self.mlp = MoELayer(config, pg_collection)
        else:
            self.mlp = MLP(config, config.ffn_hidden_size)

    def forward(self, hidden_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden_BSH = hidden_BSH + self.self_attention(self.input_layernorm(hidden_BSH), rope)
        return hidden_BSH + self.mlp(self.pre_mlp_layernorm(hidden_BSH))


class TransformerBlock(nn.Module):
    """``layers`` then ``final_layernorm`` (Megatron's ``decoder``): ``[B, S, H] -> [B, S, H]``.

    The RoPE angles are computed once per forward and shared by every layer (Megatron's ``rotary_pos_emb``).
    Under sequence parallelism ``hidden`` is this rank's ``[B, S / tp, H]`` and the angles cover all S
    positions (attention sees the whole sequence).
    """

    def __init__(self, config: TransformerConfig, pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        self.config = config
        self.sequence_parallel_size = 1 if pg_collection is None else pg_collection.tp_size
        self.layers = nn.ModuleList(TransformerLayer(config, i, pg_collection) for i in range(config.num_layers))
        self.final_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        seq = hidden_BSH.shape[1] * self.sequence_parallel_size
        rope = rope_cos_sin(seq, self.config.kv_channels, self.config.rotary_base, hidden_BSH.device)
        for layer in self.layers:
            hidden_BSH = layer(hidden_BSH, rope)
        return self.final_layernorm(hidden_BSH)


__all__ = ["TransformerLayer", "TransformerBlock"]
