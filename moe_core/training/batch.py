"""A rank's rows of a global batch, and Megatron's document masks from end-of-document tokens.

Legend (docs/design.md): B batch (sequences), S sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

IGNORE_INDEX = -100  # a label the loss skips (F.cross_entropy's ignore_index)


class Batch(NamedTuple):
    """``GPTModel.forward``'s inputs for some rows of a batch.

    Attributes:
        input_ids: ``[B, S]`` int64 token ids.
        labels: ``[B, S]`` int64 next-token targets, ``IGNORE_INDEX`` where the loss is masked.
        position_ids: ``[B, S]`` int64 RoPE positions, or None for ``0..S-1``.
        document_ids: ``[B, S]`` int64 document of each token (attention stays inside one), or None for causal
            attention over the whole row.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    def map(self, fn) -> Batch:
        """``fn`` applied to every tensor (None stays None)."""
        return Batch(*(None if t is None else fn(t) for t in self))

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self.map(torch.Tensor.pin_memory)

    def split(self, rows: int) -> list[Batch]:
        """Consecutive micro-batches of ``rows`` sequences."""
        parts = [None if t is None else t.split(rows) for t in self]
        count = len(parts[0])
        return [Batch(*(None if p is None else p[i] for p in parts)) for i in range(count)]

    @property
    def num_loss_tokens(self) -> torch.Tensor:
        """The number of labels the loss counts (not ``IGNORE_INDEX``), an int64 scalar on the labels' device."""
        return (self.labels != IGNORE_INDEX).sum()


@dataclass(frozen=True)
class DocumentMasking:
    """Megatron's ``get_ltor_masks_and_position_ids``: documents end at each ``eod`` token of the inputs.

    A document runs up to and including its EOD token; the token after it starts the next one.
    ``reset_position_ids``: positions restart at 0 there. ``reset_attention_mask``: no token attends across it
    (``document_ids`` count the EODs before each token). ``eod_mask_loss``: the loss of the positions whose
    input is an EOD (the prediction of the next document's first token) is masked.
    """

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def __call__(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> Batch:
        """The ``Batch`` of ``input_ids`` / ``labels`` ``[B, S]`` int64 with this masking."""
        is_eod_BS = input_ids_BS == self.eod
        position_ids = document_ids = None
        if self.reset_attention_mask:
            document_ids = torch.cumsum(is_eod_BS, dim=1) - is_eod_BS.long()  # EODs strictly before each token
        if self.reset_position_ids:
            positions_S = torch.arange(input_ids_BS.shape[1])
            starts_BS = torch.zeros_like(input_ids_BS)
            starts_BS[:, 1:] = torch.where(is_eod_BS[:, :-1], positions_S[1:], 0)
            position_ids = positions_S - torch.cummax(starts_BS, dim=1).values
        if self.eod_mask_loss:
            labels_BS = labels_BS.masked_fill(is_eod_BS, IGNORE_INDEX)
        return Batch(input_ids_BS, labels_BS, position_ids, document_ids)


__all__ = ["Batch", "IGNORE_INDEX", "DocumentMasking"]
