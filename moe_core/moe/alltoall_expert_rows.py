"""The all-to-all dispatcher's expert-row layout (Megatron's): a row per (token, expert) travels to the expert's EP
rank. The dispatcher keeps it for drop_and_pad, whose static shapes need a row per (token, expert) and capacity
slot, and for L = 1, where a token row and an expert row coincide.

Legend (docs/design.md): T this rank's tokens, H hidden, E experts, P EP ranks, L = E / P local experts, K topk,
C capacity, R_s rows this rank sends, R rows its experts receive, W the packed width (``moe_core.ops.pack``: a row's
H values plus its prob as a float32 tail).

dispatch:  exchange the per-expert counts unless drop_and_pad (static: C rows per expert from each rank), copy them
           to the host
           permute [T, H] -> [R_s, W] rank-major then local-expert-major (global expert order), probs in the tails;
           then wait for the counts' copy (the permute runs while they travel)   (the host sync)
           all_to_all                                       -> [R, W] grouped by (source rank, local expert)
           one gather by a device-computed index sorts by local expert and unpacks -> [R, H], probs [R]
combine:   one gather back to (source rank, local expert) order -> reverse all_to_all -> unpermute (gather-sum)
                                                            -> [T, H]
With L = 1 rows arrive sorted: rows and probs travel unpacked in two all-to-alls and nothing is sorted.

drop_and_pad's split sizes are static, so every EP rank must pass the same T: eagerly, ``ep_counts.TokenCountCheck``
exchanges T first and raises on every rank otherwise; traced or captured in a CUDA graph, the shapes are the graph's.
Under torch.compile dispatch and combine run eagerly (``token_dispatcher_alltoall.py`` says why).

Collectives, in this order on every rank: the count exchange (drop_and_pad: the token-count check's all-gather
instead, when eager), the rows' all-to-all (plus the probs' with L = 1), combine's all-to-all, their mirrors in
backward.

Host syncs: drop_and_pad: the wait for the token-count check (dispatch always runs eagerly), none when captured in a
CUDA graph. Otherwise one per dispatch: ``all_to_all_single`` takes its split sizes as host ints, so the exchanged
counts must reach the host (``CountsCopy.wait``). (With L = 1, a capacity factor and no padding, ``permute`` adds its
own to size the data-dependent rows.)

Streams (CUDA): the count exchange and its copy to pinned host memory run on a side stream
(``ep_counts.exchange_counts``) after the routing only, so they overlap the permute; the sort indices are computed
on the side stream too, while the rows' all-to-all is in flight. The current stream waits for what it uses (events).
Off CUDA all runs in order.

Precision: combine sums all K rows of a token at once in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_core.moe.alltoall_layout import chunk_transpose_index
from moe_core.moe.ep_counts import TokenCountCheck, exchange_counts, on_side_stream
from moe_core.moe.moe_utils import RowMap, permute, unpermute
from moe_core.moe.token_dispatcher import ExpertParallelTokenDispatcher, check_dispatch_inputs
from moe_core.ops.pack import unpack_rows
from moe_core.ops.permute import permute_rows
from moe_core.parallel.collectives import all_to_all


@dataclass(frozen=True)
class ExpertRowsDispatchMeta:
    """What ``ExpertRowsAlltoAllDispatcher.combine`` needs to undo ``dispatch``.

    Attributes:
        row_map: the ``moe_utils.RowMap`` of this rank's T tokens and the R_s rows it sends (``permute``'s).
        input_splits / output_splits: rows sent to / received from each EP rank (host ints).
        unsort_index: ``[R]`` int64, the expert-major row each (source rank, local expert)-major row came from
            (combine's gather); None with L = 1, where the rows arrive sorted.
        sort_index: ``[R]`` int64, its inverse permutation (the unsort's backward); None likewise.
    """

    row_map: RowMap
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    unsort_index: torch.Tensor | None
    sort_index: torch.Tensor | None


class ExpertRowsAlltoAllDispatcher(ExpertParallelTokenDispatcher):
    """All-to-all of expert rows, a row per (token, expert) (module docstring).

    Arguments and errors: see ``ExpertParallelTokenDispatcher``.
    """

    @torch.compiler.disable
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExpertRowsDispatchMeta]:
        """See ``MoETokenDispatcher.dispatch``: rows grouped by local expert, then source rank, then token index
        (with drop_and_pad, each source rank's C rows per expert, padding last).

        Raises:
            ValueError / TypeError: shapes or dtypes do not fit; with drop_and_pad, eagerly, the EP ranks pass
                different T (raised on every rank).
        """
        check_dispatch_inputs(hidden, probs, routing_map, self.num_experts)
        num_tokens, hidden_size = hidden.shape
        ep, num_local = self.ep_size, self.num_local_experts
        capacity = self.capacity(num_tokens)
        check = None if capacity is None else TokenCountCheck.start(num_tokens, self.ep_group, hidden.device)
        if capacity is None:
            sent_counts_E = routing_map.sum(dim=0)  # rows this rank sends to each expert, global order
            # received_counts[p * L + e]: rows source rank p sends to local expert e.
            received_counts, counts_copy = exchange_counts(sent_counts_E, num_local, self.ep_group)
        else:  # static: made where _received_layout reads it, the side stream on CUDA
            received_counts, = on_side_stream(
                lambda: (hidden.new_full((ep * num_local,), capacity, dtype=torch.int64),), hidden.device,
                after_current=False, join=False)
        packed = num_local > 1
        sent, sent_probs, row_map = permute(
            hidden, routing_map, probs, num_out_tokens=self.num_out_tokens(num_tokens), drop_and_pad=self.drop_and_pad,
            num_slots=None if self.drop_and_pad else self.topk, pack_probs=packed)
        if capacity is None:
            host_counts = counts_copy.wait()
            input_splits = _per_rank(host_counts[:self.num_experts], num_local)
            output_splits = _per_rank(host_counts[self.num_experts:], num_local)
        else:
            if check is not None:
                check.verify("moe_pad_expert_input_to_capacity (capacity rows per expert from each EP rank)")
            input_splits = output_splits = [num_local * capacity] * ep
        received = all_to_all(sent, output_splits, input_splits, self.ep_group)
        tokens_per_expert_L, sort_index, unsort_index = _received_layout(
            received_counts.view(ep, num_local), sum(output_splits), packed)
        splits = (tuple(input_splits), tuple(output_splits))
        if not packed:
            received_probs = all_to_all(sent_probs.float(), output_splits, input_splits, self.ep_group)
            return received, tokens_per_expert_L, received_probs, ExpertRowsDispatchMeta(row_map, *splits, None, None)
        received_RH, received_probs = unpack_rows(received, sort_index.unsqueeze(1), unsort_index.unsqueeze(1),
                                                  hidden_size, 1)
        meta = ExpertRowsDispatchMeta(row_map, *splits, unsort_index, sort_index)
        return received_RH, tokens_per_expert_L, received_probs[:, 0].index_select(0, sort_index), meta

    @torch.compiler.disable
    def combine(self, expert_output: torch.Tensor, meta: ExpertRowsDispatchMeta) -> torch.Tensor:
        """See ``MoETokenDispatcher.combine``."""
        out = expert_output  # [R, H], then [R_s, H] back on this rank
        if meta.unsort_index is not None:
            out = permute_rows(out, meta.unsort_index, meta.sort_index.unsqueeze(1))
        out = all_to_all(out, meta.input_splits, meta.output_splits, self.ep_group)
        return unpermute(out, meta.row_map)


def _received_layout(counts_PL: torch.Tensor, num_rows: int, sort: bool):
    """``(tokens_per_expert [L], sort_index [R] or None, unsort_index [R] or None)`` of expert rows received,
    ``counts_PL`` [P, L] of them from each source rank for each local expert.

    On CUDA the few dozen tiny kernels run on the dispatcher's side stream, after the count exchange queued there
    and not after the permute or the all-to-all queued on the current stream, so they stay off the critical path;
    the current stream waits for them before their first use.
    """
    def layout():
        indices = (chunk_transpose_index(counts_PL, num_rows), chunk_transpose_index(counts_PL.t(), num_rows))
        return (counts_PL.sum(dim=0), *(indices if sort else (None, None)))

    return on_side_stream(layout, counts_PL.device, counts_PL, after_current=False, join=True)


def _per_rank(counts: list[int], num_local: int) -> list[int]:
    """Sums of consecutive blocks of ``num_local`` counts: rows per EP rank."""
    return [sum(counts[i:i + num_local]) for i in range(0, len(counts), num_local)]


__all__ = ["ExpertRowsAlltoAllDispatcher", "ExpertRowsDispatchMeta"]
