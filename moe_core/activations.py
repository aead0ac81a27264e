"""MLP activations by name (``TransformerConfig.activation_func``), shared by dense MLPs and experts.

Gated ones (swiglu, geglu) take fc1's output ``[..., 2F]``: ``act(x[..., :F]) * x[..., F:]`` (Megatron's
order: the first half goes through the activation). Shazeer 2020, "GLU Variants Improve Transformer";
squared ReLU from So et al. 2021 (Primer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


_POINTWISE = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "squared_relu": _squared_relu}
_GATED = {"swiglu": F.silu, "geglu": F.gelu}


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """Apply activation ``name`` to fc1's output ``x`` ``[..., F]`` (``[..., 2F]`` for gated ones) -> ``[..., F]``.

    Raises:
        ValueError: unknown ``name``, or an odd last dimension for a gated activation.
    """
    if name in _GATED:
        if x.shape[-1] % 2:
            raise ValueError(f"x: gated activation {name!r} needs an even last dimension, got {x.shape[-1]}")
        gate, up = x.chunk(2, dim=-1)
        return _GATED[name](gate) * up
    if name in _POINTWISE:
        return _POINTWISE[name](x)
    raise ValueError(f"name: expected one of {sorted(_POINTWISE) + sorted(_GATED)}, got {name!r}")


__all__ = ["activation"]
