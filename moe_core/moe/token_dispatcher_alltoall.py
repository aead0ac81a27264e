"""All-to-all token dispatcher for expert parallelism (Megatron-LM's ``MoEAlltoAllTokenDispatcher``).

Legend (docs/design.md): T this rank's tokens, H hidden, E experts, L = E / ep local experts, K topk,
R_s rows this rank sends (T * K before dropping), R rows this rank's experts receive, C capacity.

dispatch:  permute [T, H] -> [R_s, H] grouped by global expert (so by destination EP rank)
           exchange the per-expert counts (all-to-all of E ints)
           all_to_all with split sizes                       -> [R, H] grouped by (source rank, local expert)
           sort chunks by local expert                       -> [R, H] grouped by (local expert, source rank)
combine:   the mirror image: unsort -> reverse all_to_all -> unpermute (gather-sum) -> [T, H]

Every rank issues the same collectives in the same order whatever the routing: one count exchange, one
all-to-all for the hidden rows and one for the probs in dispatch, one all-to-all in combine, and the
mirrors in backward, including a rank that sends or receives zero rows. With ``drop_and_pad`` the split sizes
are static and there is no host sync at all; otherwise the single host sync of the step (Megatron's
``preprocess``) is ``_split_sizes_to_host``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_core.config import TransformerConfig
from moe_core.moe.moe_utils import RowMap, permute, unpermute
from moe_core.moe.token_dispatcher import ExpertParallelTokenDispatcher, check_dispatch_inputs
from moe_core.parallel.collectives import all_to_all
from moe_core.parallel.process_groups import ProcessGroupCollection


@dataclass(frozen=True)
class AlltoAllDispatchMeta:
    """What ``combine`` needs to undo ``dispatch``.

    Attributes:
        row_map: the ``moe_utils.RowMap`` of this rank's tokens and the rows it sends (from ``permute``).
        input_splits / output_splits: rows sent to / received from each EP rank (host ints).
        chunk_sizes: rows received per (source rank, local expert), source-major; ``None`` with drop_and_pad.
        capacity: per-expert capacity with drop_and_pad, else ``None``.
    """

    row_map: RowMap
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    chunk_sizes: tuple[int, ...] | None
    capacity: int | None


def sort_chunks_by_idxs(x: torch.Tensor, chunk_sizes: list[int], order: list[int]) -> torch.Tensor:
    """Split ``x`` [R, ...] into chunks of ``chunk_sizes`` rows and concatenate them in ``order``.

    Megatron's ``sort_chunks_by_idxs``; differentiable (split + cat).
    """
    chunks = torch.split(x, chunk_sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


class MoEAlltoAllTokenDispatcher(ExpertParallelTokenDispatcher):
    """Token dispatcher that exchanges routed rows between EP ranks with all_to_all_single.

    Arguments and errors: see ``ExpertParallelTokenDispatcher``.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: TransformerConfig,
                 pg_collection: ProcessGroupCollection | None = None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        # Received chunks are source-major; experts want them expert-major.
        ep, num_local = self.ep_size, num_local_experts
        self._sort_order = [s * num_local + e for e in range(num_local) for s in range(ep)]
        self._unsort_order = [e * ep + s for s in range(ep) for e in range(num_local)]

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """Route ``hidden`` [T, H] to the experts' ranks.

        Args:
            hidden: ``[T, H]``; probs: ``[T, E]`` float32 (0 where not routed); routing_map: ``[T, E]`` bool.
        Returns:
            ``(permuted_hidden [R, H], tokens_per_expert [L] int64 on hidden's device, permuted_probs [R]
            float32, meta)``, rows grouped by local expert, then source rank, then token index.
        Raises:
            ValueError: shapes disagree.
        """
        check_dispatch_inputs(hidden, probs, routing_map, self.num_experts)
        num_tokens = hidden.shape[0]
        capacity = self.capacity(num_tokens)
        num_out_tokens = self.num_out_tokens(num_tokens)
        sent, sent_probs, row_map = permute(  # [R_s, H], [R_s], RowMap
            hidden, routing_map, probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=self.drop_and_pad,
            num_slots=None if self.drop_and_pad else self.topk,
        )
        if self.drop_and_pad:
            return self._dispatch_padded(sent, sent_probs, row_map, capacity)

        sent_per_expert_E = routing_map.sum(dim=0).to(torch.int64)  # rows this rank sends to each expert
        if self.ep_size == 1:
            meta = AlltoAllDispatchMeta(row_map, (), (), None, None)
            return sent, sent_per_expert_E, sent_probs.float(), meta

        # received_per_chunk[s * L + e]: rows source rank s sends to local expert e.
        received_per_chunk = all_to_all(sent_per_expert_E, [self.num_local_experts] * self.ep_size,
                                        [self.num_local_experts] * self.ep_size, self.ep_group)
        tokens_per_expert_L = received_per_chunk.view(self.ep_size, self.num_local_experts).sum(dim=0)
        input_splits, chunk_sizes = _split_sizes_to_host(
            sent_per_expert_E.view(self.ep_size, self.num_local_experts).sum(dim=1), received_per_chunk
        )
        output_splits = [sum(chunk_sizes[s * self.num_local_experts:(s + 1) * self.num_local_experts])
                         for s in range(self.ep_size)]
        received_RH = all_to_all(sent, output_splits, input_splits, self.ep_group)
        received_probs_R = all_to_all(sent_probs.float(), output_splits, input_splits, self.ep_group)
        if self.num_local_experts > 1:
            received_RH = sort_chunks_by_idxs(received_RH, chunk_sizes, self._sort_order)
            received_probs_R = sort_chunks_by_idxs(received_probs_R, chunk_sizes, self._sort_order)
        meta = AlltoAllDispatchMeta(
            row_map, tuple(input_splits), tuple(output_splits), tuple(chunk_sizes), None
        )
        return received_RH, tokens_per_expert_L, received_probs_R, meta

    def _dispatch_padded(self, sent, sent_probs, row_map, capacity):
        # Static shapes: every (rank, expert) pair exchanges exactly C = `capacity` rows; R = ep * L * C.
        ep, num_local = self.ep_size, self.num_local_experts
        splits = [num_local * capacity] * ep
        received = all_to_all(sent, splits, splits, self.ep_group)  # [ep * L * C, H], source rank major
        received_probs = all_to_all(sent_probs.float(), splits, splits, self.ep_group)
        hidden_size = sent.shape[-1]
        received_RH = received.view(ep, num_local, capacity, hidden_size).transpose(0, 1).reshape(-1, hidden_size)
        received_probs_R = received_probs.view(ep, num_local, capacity).transpose(0, 1).reshape(-1)
        tokens_per_expert_L = torch.full((num_local,), ep * capacity, dtype=torch.int64, device=sent.device)
        meta = AlltoAllDispatchMeta(row_map, tuple(splits), tuple(splits), None, capacity)
        return received_RH, tokens_per_expert_L, received_probs_R, meta

    def combine(self, expert_output: torch.Tensor, meta: AlltoAllDispatchMeta) -> torch.Tensor:
        """Return ``expert_output`` [R, H] rows to their source ranks and sum each token's rows into ``[T, H]``.

        Probs were applied inside the experts, so this is a pure sum over each token's rows.
        """
        out = expert_output  # [R, H], then [R_s, H] once back on this rank
        if self.ep_size > 1:
            if meta.capacity is not None:
                ep, num_local, hidden_size = self.ep_size, self.num_local_experts, out.shape[-1]
                out = out.view(num_local, ep, meta.capacity, hidden_size).transpose(0, 1).reshape(-1, hidden_size)
            elif self.num_local_experts > 1:
                sorted_sizes = [meta.chunk_sizes[i] for i in self._sort_order]
                out = sort_chunks_by_idxs(out, sorted_sizes, self._unsort_order)
            out = all_to_all(out, meta.input_splits, meta.output_splits, self.ep_group)
        return unpermute(out, meta.row_map)


def _split_sizes_to_host(input_splits: torch.Tensor, counts: torch.Tensor) -> tuple[list[int], list[int]]:
    # The one host sync of the non-padded path (Megatron's preprocess does the same): all_to_all_single
    # needs its split sizes on the host. One device->host copy carries both tensors.
    host = torch.cat([input_splits, counts]).tolist()
    return host[: input_splits.numel()], host[input_splits.numel():]


__all__ = [
    "MoEAlltoAllTokenDispatcher", "AlltoAllDispatchMeta", "sort_chunks_by_idxs",
]
