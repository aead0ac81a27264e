"""Token dispatchers: the interface and the single-rank implementation.

Legend (docs/design.md): T tokens, H hidden, E experts, L experts on this rank, R rows the local experts receive.

Every dispatcher has the contract of docs/design.md: ``dispatch(hidden [T, H], probs [T, E], routing_map
[T, E]) -> (permuted_hidden [R, H], tokens_per_expert [L] int64, permuted_probs [R] float32, meta)`` and
``combine(expert_output [R, H], meta) -> [T, H]``, ``meta`` a frozen dataclass. The expert-parallel ones live in
their own files: the all-to-all's layouts in ``alltoall_token_rows.py`` and ``alltoall_expert_rows.py``, with
``MoEAlltoAllTokenDispatcher`` in ``token_dispatcher_alltoall.py`` building the one a config asks for, and
``MoEAllGatherTokenDispatcher`` in ``token_dispatcher_allgather.py``; ``dispatcher_factory.py`` picks one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from moe_core.config import TransformerConfig
from moe_core.moe.capacity import get_capacity
from moe_core.moe.moe_utils import RowMap, permute, unpermute


class MoETokenDispatcher(abc.ABC):
    """Moves routed token rows to the experts that hold them and back (Megatron's ``MoETokenDispatcher``).

    Subclasses implement ``dispatch`` and ``combine``; every rank must issue the same collectives in the same
    order whatever the routing (a rank whose experts get no rows still takes part).

    Args:
        config: ``num_moe_experts``, ``moe_router_topk``, ``moe_expert_capacity_factor``,
            ``moe_pad_expert_input_to_capacity``.
    Raises:
        ValueError: ``config.num_moe_experts`` is None.
    """

    def __init__(self, config: TransformerConfig):
        if config.num_moe_experts is None:
            raise ValueError("config.num_moe_experts: a token dispatcher needs experts, got None")
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)

    @abc.abstractmethod
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """``hidden [T, H]``, ``probs [T, E]`` float (0 where not routed), ``routing_map [T, E]`` bool ->
        ``(permuted_hidden [R, H], tokens_per_expert [L] int64 on hidden's device, permuted_probs [R]
        float32, meta)``, rows grouped by local expert."""

    @abc.abstractmethod
    def combine(self, expert_output: torch.Tensor, meta: Any) -> torch.Tensor:
        """``expert_output [R, H]`` (probs already applied) -> ``[T, H]``, each token the sum of its rows."""

    def capacity(self, num_tokens: int) -> int | None:
        """Rows per expert under drop_and_pad for ``num_tokens`` local tokens, else None."""
        if not self.drop_and_pad:
            return None
        return get_capacity(num_tokens * self.topk, self.num_experts, self.config.moe_expert_capacity_factor)

    def num_out_tokens(self, num_tokens: int) -> int | None:
        """Rows ``permute`` produces from ``num_tokens`` tokens when that is known without a host sync.

        ``E * capacity`` with drop_and_pad; ``T * topk`` when nothing is dropped (the router gives every
        token exactly topk experts); None when a capacity factor drops a data-dependent number of rows.
        """
        if self.drop_and_pad:
            return self.capacity(num_tokens) * self.num_experts
        if self.config.moe_expert_capacity_factor is None:
            return num_tokens * self.topk
        return None


@dataclass(frozen=True)
class LocalDispatchMeta:
    """What ``MoELocalTokenDispatcher.combine`` needs: the ``moe_utils.RowMap`` from ``permute``."""

    row_map: RowMap


class MoELocalTokenDispatcher(MoETokenDispatcher):
    """Single-rank dispatcher (EP size 1): permute into expert-major rows, unpermute by gather-sum.

    No collective. Host syncs: none when nothing is dropped or with drop_and_pad; with a capacity factor
    and no padding, ``permute`` syncs once to size its data-dependent output.
    """

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LocalDispatchMeta]:
        """See ``MoETokenDispatcher.dispatch``; here L = E.

        Raises:
            ValueError / TypeError: shapes or dtypes do not fit; without a capacity factor, a token with other
                than topk experts (checked on the CPU only).
        """
        check_dispatch_inputs(hidden, probs, routing_map, self.num_experts)
        num_tokens = hidden.shape[0]
        permuted, permuted_probs, row_map = permute(
            hidden, routing_map, probs, num_out_tokens=self.num_out_tokens(num_tokens), drop_and_pad=self.drop_and_pad,
            num_slots=None if self.drop_and_pad else self.topk,
        )
        if self.drop_and_pad:
            tokens_per_expert = torch.full(
                (self.num_experts,), self.capacity(num_tokens), dtype=torch.int64, device=hidden.device
            )
        else:
            tokens_per_expert = routing_map.sum(dim=0)
        meta = LocalDispatchMeta(row_map)
        return permuted, tokens_per_expert, permuted_probs.float(), meta

    def combine(self, expert_output: torch.Tensor, meta: LocalDispatchMeta) -> torch.Tensor:
        """See ``MoETokenDispatcher.combine``."""
        return unpermute(expert_output, meta.row_map)


def check_dispatch_inputs(hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                          num_experts: int) -> None:
    """Raise ``ValueError``/``TypeError`` unless hidden is ``[T, H]``, probs ``[T, E]`` float and routing_map
    ``[T, E]`` bool."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected [T, H], got shape {tuple(hidden.shape)}")
    expected = (hidden.shape[0], num_experts)
    if tuple(probs.shape) != expected or tuple(routing_map.shape) != expected:
        raise ValueError(
            f"probs and routing_map: expected shape {expected}, got {tuple(probs.shape)} and "
            f"{tuple(routing_map.shape)}"
        )
    if not probs.is_floating_point():
        raise TypeError(f"probs: expected a floating dtype, got {probs.dtype}")
    if routing_map.dtype != torch.bool:
        raise TypeError(f"routing_map: expected torch.bool, got {routing_map.dtype}")


class ExpertParallelTokenDispatcher(MoETokenDispatcher):
    """Shared set-up of the dispatchers that move rows between EP ranks.

    Args:
        num_local_experts: L, experts held by this rank.
        local_expert_indices: the L global expert ids held here, contiguous
            (``ep_rank * L + [0, L)``, see ``ProcessGroupCollection.local_expert_indices``).
        config: ``TransformerConfig`` (num_moe_experts, moe_router_topk, capacity fields).
        pg_collection: ``ProcessGroupCollection``; ``None`` means one rank holding every expert.
    Raises:
        ValueError: the local experts are not this rank's contiguous block of ``num_moe_experts / ep``.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: TransformerConfig,
                 pg_collection=None):
        super().__init__(config)
        self.ep_group = None if pg_collection is None else pg_collection.ep
        self.ep_size = 1 if pg_collection is None else pg_collection.ep_size
        self.num_local_experts = num_local_experts
        check_local_experts(num_local_experts, local_expert_indices, self.num_experts, pg_collection)
        self.local_expert_indices = list(local_expert_indices)


def check_local_experts(num_local_experts: int, local_expert_indices, num_experts: int, pg_collection) -> None:
    """Raise ``ValueError`` unless the local experts are this EP rank's block ``ep_rank * L + [0, L)``."""
    ep_size = 1 if pg_collection is None else pg_collection.ep_size
    ep_rank = 0 if pg_collection is None else pg_collection.ep_rank
    expected = list(range(ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts))
    if num_local_experts * ep_size != num_experts or list(local_expert_indices) != expected:
        raise ValueError(
            f"local_expert_indices: expected {expected} (num_moe_experts={num_experts}, ep_size={ep_size}, "
            f"ep_rank={ep_rank}), got {list(local_expert_indices)}"
        )


__all__ = [
    "MoETokenDispatcher", "MoELocalTokenDispatcher", "LocalDispatchMeta", "ExpertParallelTokenDispatcher",
    "check_dispatch_inputs", "check_local_experts",
]
