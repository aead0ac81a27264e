"""moe_core: empty-group-safe grouped GEMM, token dispatch, grouped MLP and MoE GPT training in PyTorch."""

from moe_core.config import TransformerConfig

__all__ = ["TransformerConfig"]
