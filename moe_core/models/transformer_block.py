"""Pre-norm transformer layers and their stack (Megatron's ``TransformerLayer`` and ``TransformerBlock``).

Legend (docs/design.md): B batch, S sequence, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_core.config import TransformerConfig
from moe_core.mlp import MLP
from moe_core.models.attention import SelfAttention
from moe_core.models.document_mask import AttentionMask
from moe_core.models.rope import rope_at, rope_cos_sin
from moe_core.moe.moe_layer import MoELayer
from moe_core.parallel.process_groups import ProcessGroupCollection
from moe_core.recompute import OutputRecompute, checkpoint, full_recompute_groups, recompute_output


class TransformerLayer(nn.Module):
    """``x + self_attention(input_layernorm(x))``, then ``x + mlp(pre_mlp_layernorm(x))``.

    ``mlp`` is an ``MoELayer`` when ``config.is_moe_layer(layer_number)`` (0-based), else a dense ``MLP`` of
    width ``ffn_hidden_size``. Selective recompute (``config.recompute_modules``): ``mlp`` / ``moe`` checkpoint the
    MLP, ``layernorm`` recomputes the norms' outputs where the next module saved them (eagerly; with ``moe_act``,
    the experts' activation too: ``recompute.OutputRecompute``).
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        is_moe = config.is_moe_layer(layer_number)
        if is_moe:
            self.mlp = MoELayer(config, pg_collection)
        else:
            self.mlp = MLP(config, config.ffn_hidden_size)
        self.recompute_mlp = config.recomputes("moe" if is_moe else "mlp")
        self.recompute_norms = config.recomputes("layernorm")
        self.recompute_outputs = self.recompute_norms or (is_moe and config.recomputes("moe_act"))

    def forward(self, hidden_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attention_mask: AttentionMask | None = None) -> torch.Tensor:
        if self.recompute_outputs and not torch.compiler.is_compiling():
            with OutputRecompute():
                return self._forward(hidden_BSH, rope, attention_mask)
        return self._forward(hidden_BSH, rope, attention_mask)

    def _forward(self, hidden_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: AttentionMask | None) -> torch.Tensor:
        normed = self._norm(self.input_layernorm, hidden_BSH, cast=True)
        # A keyword: tensor parallelism's input plan lays out the positional inputs (hidden, rope) only.
        hidden_BSH = hidden_BSH + self.self_attention(normed, rope, attention_mask=attention_mask)
        # The router keeps the norm's output at its own precision: cast only for a dense MLP's linear.
        normed = self._norm(self.pre_mlp_layernorm, hidden_BSH, cast=not isinstance(self.mlp, MoELayer))
        return hidden_BSH + (checkpoint(self.mlp, normed) if self.recompute_mlp else self.mlp(normed))

    def _norm(self, norm: nn.RMSNorm, hidden_BSH: torch.Tensor, cast: bool) -> torch.Tensor:
        """``norm(hidden)``; with ``layernorm`` recompute, made again where its consumer saved it. A consumer that
        is a linear under autocast saves its autocast copy, so ``cast`` then recomputes that copy (the same values
        autocast would make)."""
        if not self.recompute_norms:
            return norm(hidden_BSH)
        device = hidden_BSH.device.type
        if cast and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            return recompute_output(lambda h: norm(h).to(dtype), hidden_BSH)
        return recompute_output(norm, hidden_BSH)


class TransformerBlock(nn.Module):
    """``layers`` then ``final_layernorm`` (Megatron's ``decoder``): ``[B, S, H] -> [B, S, H]``.

    The RoPE angles are computed once per forward and shared by every layer (Megatron's ``rotary_pos_emb``).
    Full recompute (``config.recompute_granularity="full"``) checkpoints runs of layers
    (``recompute.full_recompute_groups``).
    Under sequence parallelism ``hidden`` is this rank's ``[B, S / tp, H]`` and the angles cover all S
    positions (attention sees the whole sequence). ``position_ids`` ``[B, S]`` pick each token's angle (RoPE
    restarting at every document); ``attention_mask`` goes to every layer's attention.
    """

    def __init__(self, config: TransformerConfig, pg_collection: ProcessGroupCollection | None = None):
        super().__init__()
        self.config = config
        self.sequence_parallel_size = 1 if pg_collection is None else pg_collection.tp_size
        self.layers = nn.ModuleList(TransformerLayer(config, i, pg_collection) for i in range(config.num_layers))
        self.final_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.layer_runs = [(0, config.num_layers, False)]
        if config.recompute_granularity == "full":
            self.layer_runs = full_recompute_groups(config.num_layers, config.recompute_method,
                                                    config.recompute_num_layers)

    def forward(self, hidden_BSH: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: AttentionMask | None = None) -> torch.Tensor:
        seq = hidden_BSH.shape[1] * self.sequence_parallel_size
        rope = rope_cos_sin(seq, self.config.kv_channels, self.config.rotary_base, hidden_BSH.device)
        if position_ids is not None:
            rope = rope_at(*rope, position_ids)
        for start, stop, recomputed in self.layer_runs:
            def run(hidden, start=start, stop=stop):
                for layer in self.layers[start:stop]:
                    hidden = layer(hidden, rope, attention_mask)
                return hidden

            hidden_BSH = checkpoint(run, hidden_BSH) if recomputed else run(hidden_BSH)
        return self.final_layernorm(hidden_BSH)


__all__ = ["TransformerLayer", "TransformerBlock"]
