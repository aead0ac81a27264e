"""The op boundary: custom ops backed by csrc/ kernels, their fake kernels and autograd."""

from moe_core.ops.grouped_gemm import grouped_gemm

__all__ = ["grouped_gemm"]
