"""The dense MLP (Megatron's ``MLP``): linear_fc1 -> activation -> linear_fc2.

Used as the dense layer of the GPT, as each expert of ``SequentialMLP`` and as the shared expert.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_core.activations import activation
from moe_core.config import TransformerConfig


class MLP(nn.Module):
    """``[..., H] -> [..., H]`` with width ``ffn_hidden_size`` (fc1 is twice as wide for gated activations).

    Init: normal(0, init_method_std); fc2 with std / sqrt(2 * num_layers) (Megatron's
    output_layer_init_method, GPT-2's scaled residual init). Biases (``add_bias_linear``) start at zero.
    """

    def __init__(self, config: TransformerConfig, ffn_hidden_size: int):
        super().__init__()
        self.activation_func = config.activation_func
        fc1_out = 2 * ffn_hidden_size if config.gated_linear_unit else ffn_hidden_size
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)
        init_linear(self.linear_fc1, config.init_method_std)
        init_linear(self.linear_fc2, config.init_method_std / math.sqrt(2 * config.num_layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.linear_fc1(hidden), self.activation_func))


def init_linear(linear: nn.Linear, std: float) -> None:
    """Normal(0, std) weight, zero bias."""
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


__all__ = ["MLP", "init_linear"]
