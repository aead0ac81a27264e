"""Whether the Triton kernels of ``moe_core/ops/triton/`` can run: CUDA and an importable triton."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    """True when torch sees a CUDA device and triton imports; ``MOE_CORE_TRITON=0`` forces False (the
    PyTorch references then run on CUDA too)."""
    if os.environ.get("MOE_CORE_TRITON", "1") == "0":
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
