"""The all-to-all dispatcher's token-row layouts: a token travels once to each EP rank it reaches, however many of
its experts that rank holds (top-8 of 128 experts over 2 ranks: at most 2 rows per token, where one row per expert
sends 8), and the receiver expands it into one row per local expert.

Legend (docs/design.md): T this rank's tokens, H hidden, E experts, P EP ranks, L = E / P local experts, K topk,
M_s token rows this rank sends, M token rows it receives, R rows its experts receive, W the packed width
(``moe_core.ops.pack``: a row's H values plus a tail of L float32 values).

``TokenRowsAlltoAllDispatcher`` (the default when L > 1): a token goes to the EP ranks holding any of its experts.

dispatch:  exchange the counts (per peer: rows for each of its L experts and the tokens it gets), copy them to the
           host and wait                                   (the host sync)
           pack [T, H] -> [M_s, W] rank-major, token order; each row's tail holds its token's probs for that rank's
           L experts, -inf where not routed                (one gather)
           all_to_all                                       -> [M, W] source-major
           the expert-major row map from the tails          (received_row_map: three kernels on CUDA)
           gather by local expert out of the packed rows    -> [R, H], probs [R]   (one gather)
combine:   sum each received token's expert rows           -> [M, H]             (gather-sum)
           reverse all_to_all                               -> [M_s, H]
           sum each token's rows from its ranks             -> [T, H]             (gather-sum)

``SyncFreeTokenRowsAlltoAllDispatcher`` (``moe_dispatch_sync_free``): every token goes to every EP rank, its tail -inf
for the experts it does not reach there: equal split sizes, T rows per peer (M_s = M = P * T), so no count exchange
and no host sync. The same steps without the first; R is sized for the worst case, M * min(K, L), the rows past
``tokens_per_expert``'s sum unused (token -2 in the row map, left unwritten on CUDA, prob 0; the grouped GEMM never
reads them). Every EP rank must pass the same T: eagerly, ``ep_counts.TokenCountCheck`` exchanges T first and
raises on every rank otherwise; traced or captured in a CUDA graph, the shapes are the graph's. Its static shapes
trace whole under torch.compile (the all-to-alls functional collectives); ``TokenRowsAlltoAllDispatcher`` runs
eagerly there (``token_dispatcher_alltoall.py`` says why).

Collectives, in this order on every rank: the count exchange (sync-free: the token-count check's all-gather, when
eager), the rows' all-to-all, combine's all-to-all, their mirrors in backward.

Host syncs: one per dispatch (Megatron's ``preprocess`` has the same): ``all_to_all_single`` takes its split sizes
as host ints, so the exchanged counts must reach the host (``CountsCopy.wait``), which also sizes the row maps.
Sync-free: none when traced or captured; eagerly, the wait for the token-count check. Backward needs no host data
beyond the same splits.

Streams (CUDA): the count exchange and its copy to pinned host memory run on a side stream
(``ep_counts.exchange_counts``) after the routing only, so they overlap the work queued after them (the rows to
send and their tails). Off CUDA all runs in order.

Precision: combine rounds each rank's partial sum to the rows' dtype before the return trip (the all-gather
dispatcher's reduce-scatter does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_core.moe.alltoall_layout import all_token_rows, received_row_map, row_probs, token_rows
from moe_core.moe.ep_counts import TokenCountCheck, exchange_counts
from moe_core.moe.moe_utils import RowMap, check_num_slots, compute_dtype, gather_row_probs, unpermute
from moe_core.moe.token_dispatcher import ExpertParallelTokenDispatcher, check_dispatch_inputs
from moe_core.ops.pack import pack_rows, packed_values, unpack_rows
from moe_core.ops.permute import unpermute_rows
from moe_core.parallel.collectives import all_to_all


@dataclass(frozen=True)
class TokenRowsDispatchMeta:
    """What ``TokenRowsAlltoAllDispatcher.combine`` needs to undo ``dispatch``.

    Attributes:
        sent_map: the ``moe_utils.RowMap`` of this rank's T tokens and the M_s token rows it sends.
        received_map: the ``RowMap`` of the M token rows received (as tokens) and the R expert rows.
        input_splits / output_splits: token rows sent to / received from each EP rank (host ints).
    """

    sent_map: RowMap
    received_map: RowMap
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]


@dataclass(frozen=True)
class SyncFreeTokenRowsDispatchMeta:
    """What ``SyncFreeTokenRowsAlltoAllDispatcher.combine`` needs to undo ``dispatch``.

    Attributes:
        sent_map / received_map: as in ``TokenRowsDispatchMeta``.
        num_tokens: T, the token rows sent to and received from each EP rank.
    """

    sent_map: RowMap
    received_map: RowMap
    num_tokens: int


class _TokenRowsExchange(ExpertParallelTokenDispatcher):
    """The steps both token-row layouts share, once the rows to send and their split sizes are known."""

    def _send_rows(self, hidden: torch.Tensor, sent_map: RowMap, values: torch.Tensor, input_splits: list[int],
                   output_splits: list[int], num_expert_rows: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RowMap]:
        """Pack the token rows of ``sent_map`` with their tails ``values`` [M_s, L] (``row_probs``), exchange them,
        expand them by local expert into ``num_expert_rows`` (R) rows.

        Returns:
            ``(rows_RH, tokens_per_expert_L, probs_R, received_map)``: dispatch's first three outputs, and the
            ``RowMap`` of the received token rows and the expert rows.
        """
        hidden_size, num_local = hidden.shape[1], self.num_local_experts
        packed = pack_rows(hidden, values, sent_map.token_of_row.unsqueeze(1), sent_map.row_of_slot,
                           compute_dtype(hidden))  # [M_s, W]
        received_MW = all_to_all(packed, output_splits, input_splits, self.ep_group)
        received_map, value_index, tokens_per_expert_L = received_row_map(
            packed_values(received_MW, hidden_size, num_local), self.topk, num_expert_rows)
        rows_RH, probs_ML = unpack_rows(received_MW, received_map.token_of_row.unsqueeze(1), received_map.row_of_slot,
                                        hidden_size, num_local)
        probs_R = gather_row_probs(probs_ML, value_index, received_map.token_of_row >= 0)  # unused rows: 0
        return rows_RH, tokens_per_expert_L, probs_R, received_map

    def _return_rows(self, expert_output: torch.Tensor, sent_map: RowMap, received_map: RowMap,
                     input_splits: list[int] | tuple[int, ...], output_splits: list[int] | tuple[int, ...]
                     ) -> torch.Tensor:
        """``expert_output`` [R, H] -> ``[T, H]``: each received token's expert rows summed, sent back, and each
        token's rows from its ranks summed."""
        out_MH = unpermute_rows(expert_output, received_map.token_of_row, received_map.row_of_slot)
        returned = all_to_all(out_MH, input_splits, output_splits, self.ep_group)  # [M_s, H]
        return unpermute(returned, sent_map)


class TokenRowsAlltoAllDispatcher(_TokenRowsExchange):
    """All-to-all of token rows, a token once per EP rank holding any of its experts (module docstring).

    Arguments and errors: see ``ExpertParallelTokenDispatcher``.
    """

    @torch.compiler.disable
    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TokenRowsDispatchMeta]:
        """See ``MoETokenDispatcher.dispatch``: rows grouped by local expert, then source rank, then token index.

        Raises:
            ValueError / TypeError: shapes or dtypes do not fit; a token with more than topk experts (checked on
                the CPU only).
        """
        check_dispatch_inputs(hidden, probs, routing_map, self.num_experts)
        check_num_slots(routing_map, self.topk)
        num_tokens, ep, num_local = hidden.shape[0], self.ep_size, self.num_local_experts
        routing_TPL = routing_map.view(num_tokens, ep, num_local)
        dest_TP = routing_TPL.any(dim=2)  # token t goes to EP rank p
        # [P, L + 1]: per peer, rows for each of its local experts, then the tokens it gets.
        counts = torch.cat([routing_TPL.sum(dim=0), dest_TP.sum(dim=0, keepdim=True).t()], dim=1)
        _, counts_copy = exchange_counts(counts.reshape(-1), num_local + 1, self.ep_group)
        # Sized for T * P rows until the host knows M_s: all of it queued before the host waits.
        token_of_row, dest_of_row, row_of_slot = token_rows(dest_TP)
        values = row_probs(routing_map, probs, token_of_row, dest_of_row, ep)  # [T * P, L]
        host = counts_copy.wait()
        sent, received = host[:ep * (num_local + 1)], host[ep * (num_local + 1):]
        input_splits, output_splits = sent[num_local::num_local + 1], received[num_local::num_local + 1]
        num_sent = sum(input_splits)
        sent_map = RowMap(token_of_row[:num_sent], row_of_slot)
        rows_RH, tokens_per_expert_L, probs_R, received_map = self._send_rows(
            hidden, sent_map, values[:num_sent], input_splits, output_splits, sum(received) - sum(output_splits))
        meta = TokenRowsDispatchMeta(sent_map, received_map, tuple(input_splits), tuple(output_splits))
        return rows_RH, tokens_per_expert_L, probs_R, meta

    @torch.compiler.disable
    def combine(self, expert_output: torch.Tensor, meta: TokenRowsDispatchMeta) -> torch.Tensor:
        """See ``MoETokenDispatcher.combine``."""
        return self._return_rows(expert_output, meta.sent_map, meta.received_map, meta.input_splits,
                                 meta.output_splits)


class SyncFreeTokenRowsAlltoAllDispatcher(_TokenRowsExchange):
    """All-to-all of token rows, every token to every EP rank: static shapes, no host sync (module docstring).

    Arguments and errors: see ``ExpertParallelTokenDispatcher``.
    """

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SyncFreeTokenRowsDispatchMeta]:
        """See ``MoETokenDispatcher.dispatch``: rows grouped by local expert, then source rank, then token index,
        then ``R - tokens_per_expert.sum()`` unused rows (prob 0).

        Raises:
            ValueError / TypeError: shapes or dtypes do not fit; a token with more than topk experts (checked on
                the CPU only); eagerly, the EP ranks pass different T (raised on every rank).
        """
        check_dispatch_inputs(hidden, probs, routing_map, self.num_experts)
        check_num_slots(routing_map, self.topk)
        num_tokens, ep = hidden.shape[0], self.ep_size
        check = TokenCountCheck.start(num_tokens, self.ep_group, hidden.device)
        token_of_row, dest_of_row, row_of_slot = all_token_rows(num_tokens, ep, hidden.device)
        values = row_probs(routing_map, probs, token_of_row, dest_of_row, ep)  # [P * T, L]
        if check is not None:
            check.verify("moe_dispatch_sync_free (every token to every EP rank, T rows each)")
        splits = [num_tokens] * ep
        bound = ep * num_tokens * min(self.topk, self.num_local_experts)  # every token on its K experts
        sent_map = RowMap(token_of_row, row_of_slot)
        rows_RH, tokens_per_expert_L, probs_R, received_map = self._send_rows(hidden, sent_map, values, splits,
                                                                              splits, bound)
        return rows_RH, tokens_per_expert_L, probs_R, SyncFreeTokenRowsDispatchMeta(sent_map, received_map,
                                                                                    num_tokens)

    def combine(self, expert_output: torch.Tensor, meta: SyncFreeTokenRowsDispatchMeta) -> torch.Tensor:
        """See ``MoETokenDispatcher.combine``."""
        splits = [meta.num_tokens] * self.ep_size
        return self._return_rows(expert_output, meta.sent_map, meta.received_map, splits, splits)


__all__ = [
    "TokenRowsAlltoAllDispatcher", "SyncFreeTokenRowsAlltoAllDispatcher", "TokenRowsDispatchMeta",
    "SyncFreeTokenRowsDispatchMeta",
]
