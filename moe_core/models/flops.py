"""Megatron-LM's count of a training step's FLOPs, to compare throughput with published Megatron figures.

Legend (docs/design.md): L layers, H hidden, F ffn widths, K experts per token, Nq / Nkv heads, D head dim,
S sequence, V vocabulary.
"""

from __future__ import annotations

from moe_core.config import TransformerConfig


def megatron_flops_per_token(config: TransformerConfig) -> float:
    """Training FLOPs (forward and backward) per token as Megatron-LM's ``num_floating_point_operations`` counts
    them for a GPT with GQA and MoE (megatron/training/training.py; Narayanan et al. 2021, appendix).

    Every GEMM counts ``3 x 2 m n k`` (forward, dgrad, wgrad): the dense or routed MLPs (``K`` experts of width
    ``F_moe`` per MoE layer, plus the shared expert; ``3F`` gated, ``2F`` not), the q / k / v and output
    projections, the core attention at half of ``S`` (the causal mask), and the logits ``H x V``. Unlike
    ``GPTModel.flops_per_token`` (PaLM's count: ``6 x`` active parameters plus the full ``S x S`` attention) it
    leaves out the router, norms and biases and halves the attention scores.
    """
    cfg = config
    widths = 3 if cfg.gated_linear_unit else 2
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense_layers = cfg.num_layers - moe_layers
    mlp = cfg.ffn_hidden_size * widths * dense_layers
    if moe_layers:
        shared = cfg.moe_shared_expert_intermediate_size or 0
        mlp += (cfg.moe_ffn_hidden_size * cfg.moe_router_topk + shared) * widths * moe_layers
    query, key_value = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    attention = cfg.hidden_size * (query + 2 * key_value) + query * cfg.seq_length + query * cfg.hidden_size
    return 6.0 * (cfg.hidden_size * mlp + cfg.num_layers * attention + cfg.hidden_size * cfg.vocab_size)


__all__ = ["megatron_flops_per_token"]
