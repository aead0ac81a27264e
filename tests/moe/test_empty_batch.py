"""MoELayer on an empty batch (no sequences, or sequences of length 0) with every load-balancing loss."""

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.moe.moe_layer import MoELayer


@pytest.mark.parametrize("balancing", ["seq_aux_loss", "aux_loss", "global_aux_loss"])
@pytest.mark.parametrize("shape", [(0, 5, 8), (2, 0, 8)])
def test_empty_batch_gives_empty_output_and_zero_grads(balancing, shape):
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                            moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    layer = MoELayer(cfg)
    hidden = torch.randn(*shape, requires_grad=True)
    out = layer(hidden)
    assert out.shape == shape
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())
