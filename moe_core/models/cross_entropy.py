"""Per-token cross-entropy of the output layer, optionally in chunks of tokens.

Legend (docs/design.md): T tokens, H hidden, V vocabulary, C tokens per chunk.

Without chunks the ``[T, V]`` float32 logits live through backward; at long context and a large vocabulary
they are the largest activation of the model (the TRL report in docs halved its memory by chunking). With
``chunk_size`` C each chunk's logits exist only while its loss is computed: forward keeps the chunk's inputs,
backward recomputes the chunk's logits (``torch.utils.checkpoint``, non-reentrant), so the peak is
``[C, V]``, at the price of the output matmul once more in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _cross_entropy(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, labels_C: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden_CH, weight_VH).float(), labels_C, reduction="none")


def chunked_cross_entropy(hidden_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor,
                          chunk_size: int | None = None) -> torch.Tensor:
    """``cross_entropy(hidden @ weight^T, labels)`` per token, float32 in nats; label -100 gives exactly 0.

    Args:
        hidden_TH: ``[T, H]`` float (the final norm's output).
        weight_VH: ``[V, H]`` output projection.
        labels_T: ``[T]`` int64 targets in ``[0, V)`` or -100.
        chunk_size: C tokens at a time (module docstring); None: all T at once.
    Returns:
        ``[T]`` float32. The logits GEMM runs in the autocast / input dtype and is upcast before the softmax.
    """
    if chunk_size is None or hidden_TH.shape[0] <= chunk_size:
        return _cross_entropy(hidden_TH, weight_VH, labels_T)
    losses = [checkpoint(_cross_entropy, h, weight_VH, y, use_reentrant=False)
              for h, y in zip(hidden_TH.split(chunk_size), labels_T.split(chunk_size), strict=True)]
    return torch.cat(losses)


__all__ = ["chunked_cross_entropy"]
