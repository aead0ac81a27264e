"""Triton kernels of the MoE data path (CUDA only); each file holds kernels and their launchers, nothing else.
The op layer (``moe_core/ops/*.py``) calls them on CUDA and the PyTorch references (``ops/reference.py``)
elsewhere."""
