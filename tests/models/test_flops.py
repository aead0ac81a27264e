"""Megatron's FLOPs count against the terms of its formula written out for Qwen3-30B-A3B and a dense gelu model."""

from pathlib import Path

from moe_core.config import TransformerConfig
from moe_core.models.flops import megatron_flops_per_token

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_qwen3_30b_a3b():
    # H 2048, 48 layers, 32 query heads, 4 KV heads of 128, S 4096, V 151936, top-8 experts of width 768 (SwiGLU).
    routed = 2048 * 768 * 8 * 3 * 48
    attention = 48 * (2048 * (32 + 2 * 4) * 128 + 32 * 128 * 4096 + 32 * 128 * 2048)
    logits = 2048 * 151936
    config = TransformerConfig.from_yaml(CONFIGS / "qwen3_30b_a3b.yaml")
    assert megatron_flops_per_token(config) == 6 * (routed + attention + logits) == 23_006_281_728


def test_dense_layers_shared_expert_and_ungated_mlp():
    config = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=100,
                               seq_length=32, activation_func="gelu", num_moe_experts=8, moe_router_topk=2,
                               moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=96, moe_layer_freq=[0, 1, 1])
    mlp = 64 * (256 * 2 * 1 + (48 * 2 + 96) * 2 * 2)  # one dense layer, two MoE layers, two GEMMs each (ungated)
    attention = 3 * (64 * 3 * 64 + 64 * 32 + 64 * 64)
    assert megatron_flops_per_token(config) == 6 * (mlp + attention + 64 * 100)
