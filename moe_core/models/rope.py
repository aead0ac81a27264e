"""Rotary position embedding (Su et al. 2021, RoFormer), the rotate-half form used by GPT-NeoX, Llama and Megatron.

Legend (docs/design.md): B batch, N heads, S sequence, D head dim.
"""

from __future__ import annotations

import torch


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[S, D]`` float32 for positions 0..S-1: pair i turns at frequency ``base^(-2i/D)``.

    Dimension j and j + D/2 form pair j (rotate-half layout), so both halves carry the same angles. The
    inverse frequencies are ``1 / base ** (arange(0, D, 2) / D)`` in float32, the rounding of Megatron's
    ``RotaryEmbedding`` and Hugging Face's default RoPE: ``base ** (-arange / D)`` differs by 1 ulp on some
    frequencies, an angle error that grows with the position.
    """
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # [S, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_at(cos_SD: torch.Tensor, sin_SD: torch.Tensor, position_ids_BS: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The angles of ``position_ids`` ``[B, S]`` (each in ``[0, S)``, e.g. restarting at every document) from the
    tables of positions ``0..S-1``: ``cos``, ``sin`` ``[B, 1, S, D]``, which ``apply_rope`` broadcasts over heads."""
    return cos_SD[position_ids_BS].unsqueeze(1), sin_SD[position_ids_BS].unsqueeze(1)


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, N, S, D]`` by position: ``x * cos + rotate_half(x) * sin``, in float32, returned in
    x's dtype (bf16 angles would lose the slow frequencies' small steps). ``cos`` / ``sin``: ``[S, D]``, or
    ``[B, 1, S, D]`` per sequence (``rope_at``)."""
    x = x_BNSD.float()
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x * cos_SD + rotated * sin_SD).to(x_BNSD.dtype)


__all__ = ["rope_cos_sin", "rope_at", "apply_rope"]
