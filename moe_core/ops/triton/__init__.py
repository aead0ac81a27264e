"""Triton kernels of the MoE data path (CUDA only); each file holds kernels and their launchers, nothing else.
The op layer (``moe_core/ops/*.py``) calls them on CUDA and the PyTorch references (``ops/reference.py``)
elsewhere.

Launchers called inside a ``torch.library.triton_op`` launch ``torch.library.wrap_triton(kernel)`` while it is
traced (fake or functional tensors), which puts the launch itself into the graph, so Inductor calls the kernel
from its generated code instead of the op's Python dispatch; with plain tensors they launch the kernel directly,
as the wrapper's dispatch costs host time.
"""

import torch


def plain(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is a plain ``torch.Tensor`` (not traced): launch the kernel itself."""
    return all(type(t) is torch.Tensor for t in tensors)
