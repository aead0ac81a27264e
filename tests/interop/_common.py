"""What the interop tests share: tiny random Hugging Face models built from config objects (nothing is
downloaded), one per architecture and routing variant."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

TINY = dict(num_hidden_layers=2, num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
CASES = {  # GQA, head_dim != H / heads, 8 and 16 experts, top-2 and top-4, both norm_topk_prob, dense layers, tying
    "qwen3-gqa-hd16-e8k2": lambda: Qwen3MoeConfig(
        **TINY, vocab_size=128, hidden_size=32, num_key_value_heads=2, head_dim=16, intermediate_size=48,
        moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3-e16k4-dense-tied": lambda: Qwen3MoeConfig(
        **{**TINY, "num_hidden_layers": 3}, vocab_size=160, hidden_size=48, num_key_value_heads=1, head_dim=8,
        intermediate_size=64, moe_intermediate_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
        mlp_only_layers=[1], tie_word_embeddings=True),
    "mixtral-gqa-hd16-e8k2": lambda: MixtralConfig(
        **TINY, vocab_size=128, hidden_size=32, num_key_value_heads=2, head_dim=16, intermediate_size=24,
        num_local_experts=8, num_experts_per_tok=2),
    "mixtral-e16k4": lambda: MixtralConfig(
        **{**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, vocab_size=256, hidden_size=64,
        num_key_value_heads=4, intermediate_size=32, num_local_experts=16, num_experts_per_tok=4),
    "olmoe-gqa-e16k4": lambda: OlmoeConfig(
        **TINY, vocab_size=128, hidden_size=32, num_key_value_heads=2, intermediate_size=24, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=False, pad_token_id=1, eos_token_id=2),
    "olmoe-e8k2-norm": lambda: OlmoeConfig(
        **TINY, vocab_size=128, hidden_size=32, intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, pad_token_id=1, eos_token_id=2),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are O(1) and routing depends on every tensor; norm weights around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.15 * torch.randn(p.shape,
                                                                                                      generator=g))


def build_hf(hf_config, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    randomize(model, seed + 1)
    return model
