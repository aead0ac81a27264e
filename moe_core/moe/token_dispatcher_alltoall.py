"""All-to-all token dispatcher for expert parallelism (Megatron-LM's ``MoEAlltoAllTokenDispatcher``).

Legend (docs/design.md): T this rank's tokens, H hidden, E experts, L = E / ep local experts, K topk, N_s rows
this rank sends, N rows it receives, R rows its experts receive, C capacity, W the packed width
(``moe_core.ops.pack``: a row's H values plus a tail of float32 values).

Both layouts below hand the experts the same rows in the same order: grouped by local expert, then source rank,
then token index (the all-gather dispatcher's order too).

Token rows (the default; L > 1 without drop_and_pad): a token travels once to each EP rank holding any of its
experts, however many it holds there (top-8 of 128 experts over 2 ranks: at most 2 rows per token where one row
per expert sends 8), and the receiver expands it.

dispatch:  exchange the counts (per peer: rows for each of its L experts and the tokens it gets), copy them to the
           host and wait                                   (the host sync)
           pack [T, H] -> [N_s, W] rank-major, token order; each row's tail holds its token's probs for that rank's
           L experts, -inf where not routed                (one gather)
           all_to_all                                       -> [N, W] source-major
           the expert-major row map from the tails          (received_row_map: three kernels on CUDA)
           gather by local expert out of the packed rows    -> [R, H], probs [R]   (one gather)
combine:   sum each received token's expert rows           -> [N, H]             (gather-sum)
           reverse all_to_all                               -> [N_s, H]
           sum each token's rows from its ranks             -> [T, H]             (gather-sum)

Sync-free token rows (``moe_dispatch_sync_free``): every token travels to every EP rank (equal split sizes, T per
peer, so no count exchange and no host sync), its tail -inf for the experts it does not reach there; the receiver's
expert rows are sized for the worst case, N * min(K, L), the rows past ``tokens_per_expert``'s sum unused (token
-2 in the row map, left unwritten on CUDA, prob 0; the grouped GEMM never reads them). Every EP rank must pass the
same T: eagerly, ``ep_counts.TokenCountCheck`` exchanges T first and raises on every rank otherwise (drop_and_pad's
static splits likewise); traced or captured in a CUDA graph, the shapes are the graph's.

Expert rows (drop_and_pad, whose static shapes need a row per (token, expert) and capacity slot; and L = 1, where
both layouts coincide): Megatron's layout.

dispatch:  exchange the per-expert counts unless drop_and_pad (static), copy to the host
           permute [T, H] -> [R_s, W] rank-major then local-expert-major (global expert order), probs in the tails;
           then wait for the counts' copy (the permute runs while they travel)
           all_to_all                                       -> [R, W] grouped by (source rank, local expert)
           one gather by a device-computed index sorts by local expert and unpacks -> [R, H], probs [R]
combine:   one gather back to (source rank, local expert) order -> reverse all_to_all -> unpermute (gather-sum)
With L = 1 rows arrive sorted: rows and probs travel unpacked in two all-to-alls and nothing is sorted.

Under torch.compile the EP exchange (dispatch and combine at ep > 1) runs eagerly: its split sizes are host data
from the count exchange, which a traced graph would have to take as symbolic sizes (some torch releases fail to
trace them). The expert compute around it compiles. The sync-free token rows have static shapes and trace whole:
the layer is one graph, its all-to-alls functional collectives.

Every rank issues the same collectives in the same order whatever the routing, a rank sending or receiving nothing
included: the count exchange (with drop_and_pad or sync-free, the token-count check's all-gather instead, when
eager), the rows' all-to-all (plus the probs' with L = 1), combine's all-to-all, and their mirrors in backward.

Host syncs: none with drop_and_pad or moe_dispatch_sync_free (static split sizes) when traced or captured; eagerly
those wait for the token-count check, exchanged before the rows are packed; otherwise one per dispatch
(Megatron's ``preprocess`` has the same): ``all_to_all_single`` takes its split sizes as host ints, so the exchanged
counts must reach the host (``CountsCopy.wait``), which also sizes the row maps without more syncs. (With L = 1, a
capacity factor and no padding, ``permute`` adds its own to size the data-dependent rows.) Backward needs no host
data beyond the same splits.

Streams (CUDA): the count exchange and its copy to pinned host memory run on a side stream
(``ep_counts.on_side_stream``) after the routing only, so they overlap the work queued after
them (the experts' ids and probs per token; the sort indices of the expert-row layout, computed there while the
rows' all-to-all is in flight). The current stream waits for what it uses (events). Off CUDA all runs in order.

Precision: the token-row combine rounds each rank's partial sum to the rows' dtype before the return trip (the
all-gather dispatcher's reduce-scatter does the same); the expert-row combine sums all K rows at once in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_core.moe.alltoall_layout import (
    all_token_rows,
    chunk_transpose_index,
    received_row_map,
    row_probs,
    token_rows,
)
from moe_core.moe.ep_counts import CountsCopy, TokenCountCheck, on_side_stream
from moe_core.moe.moe_utils import (
    RowMap,
    check_num_slots,
    compute_dtype,
    gather_row_probs,
    permute,
    unpermute,
)
from moe_core.moe.token_dispatcher import ExpertParallelTokenDispatcher, check_dispatch_inputs
from moe_core.ops.pack import pack_rows, packed_values, unpack_rows
from moe_core.ops.permute import permute_rows, unpermute_rows
from moe_core.parallel.collectives import all_to_all


@dataclass(frozen=True)
class AlltoAllDispatchMeta:
    """What ``combine`` needs to undo ``dispatch``.

    Attributes:
        row_map: the ``moe_utils.RowMap`` of this rank's tokens and the rows it sends.
        input_splits / output_splits: rows sent to / received from each EP rank (host ints).
        received_map: token rows: the ``RowMap`` of the received rows (as tokens) and the experts' rows; None for
            expert rows.
        unsort_index: expert rows with L > 1: ``[R]`` int64, the expert-major row each (source rank, local
            expert)-major row came from (combine's gather); else None.
        sort_index: ``[R]`` int64, its inverse permutation (the unsort's backward); None likewise.
    """

    row_map: RowMap
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    received_map: RowMap | None = None
    unsort_index: torch.Tensor | None = None
    sort_index: torch.Tensor | None = None


class MoEAlltoAllTokenDispatcher(ExpertParallelTokenDispatcher):
    """Token dispatcher that exchanges routed rows between EP ranks with all_to_all_single.

    Arguments and errors: see ``ExpertParallelTokenDispatcher``.
    """

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
        if self.ep_size == 1:
            sent, sent_probs, row_map = permute(hidden, routing_map, **self._permute_kwargs(hidden.shape[0], probs))
            capacity = self.capacity(hidden.shape[0])
            counts_L = routing_map.sum(dim=0) if capacity is None else torch.full(
                (self.num_local_experts,), capacity, dtype=torch.int64, device=hidden.device)
            return sent, counts_L, sent_probs.float(), AlltoAllDispatchMeta(row_map, (), ())
        if self.token_rows:
            return self._dispatch_token_rows(hidden, probs, routing_map)
        return self._dispatch_expert_rows(hidden, probs, routing_map)

    @property
    def token_rows(self) -> bool:
        """Whether rows travel per (token, EP rank) (module docstring); else per (token, expert)."""
        return not self.drop_and_pad and (self.num_local_experts > 1 or self.config.moe_dispatch_sync_free)

    def combine(self, expert_output: torch.Tensor, meta: AlltoAllDispatchMeta) -> torch.Tensor:
        """Return ``expert_output`` [R, H] rows to their source ranks and sum each token's rows into ``[T, H]``.

        Probs were applied inside the experts, so this is a pure sum over each token's rows.
        """
        if self.ep_size == 1:
            return unpermute(expert_output, meta.row_map)
        if self.config.moe_dispatch_sync_free and meta.received_map is not None:
            return self._combine_ep(expert_output, meta)
        return self._combine_ep_eager(expert_output, meta)

    def _combine_ep(self, expert_output: torch.Tensor, meta: AlltoAllDispatchMeta) -> torch.Tensor:
        out = expert_output  # [R, H], then [N or R, H] to send, then [N_s or R_s, H] back on this rank
        if meta.received_map is not None:
            out = unpermute_rows(out, meta.received_map.token_of_row, meta.received_map.row_of_slot)
        elif meta.unsort_index is not None:
            out = permute_rows(out, meta.unsort_index, meta.sort_index.unsqueeze(1))
        out = all_to_all(out, meta.input_splits, meta.output_splits, self.ep_group)
        return unpermute(out, meta.row_map)

    # Split sizes from a host sync: traced, they would be constants of the graph, so the exchange stays eager.
    _combine_ep_eager = torch.compiler.disable(_combine_ep)

    def _permute_kwargs(self, num_tokens: int, probs: torch.Tensor) -> dict:
        return dict(probs=probs, num_out_tokens=self.num_out_tokens(num_tokens), drop_and_pad=self.drop_and_pad,
                    num_slots=None if self.drop_and_pad else self.topk)

    def _dispatch_token_rows(self, hidden, probs, routing_map):
        check_num_slots(routing_map, self.topk)
        if not self.config.moe_dispatch_sync_free:
            return self._dispatch_token_rows_eager(hidden, probs, routing_map)
        # Static shapes, so torch.compile traces this (the all-to-alls as functional collectives).
        num_tokens, ep = hidden.shape[0], self.ep_size
        check = TokenCountCheck.start(num_tokens, self.ep_group, hidden.device)
        token_of_row, dest_of_row, row_of_slot = all_token_rows(num_tokens, ep, hidden.device)
        values = row_probs(routing_map, probs, token_of_row, dest_of_row, ep)  # [ep * T, L]
        if check is not None:
            check.verify("moe_dispatch_sync_free (every token to every EP rank, T rows each)")
        splits = [num_tokens] * ep
        bound = ep * num_tokens * min(self.topk, self.num_local_experts)  # every token on its K experts
        return self._send_token_rows(hidden, token_of_row, row_of_slot, values, splits, splits, bound)

    @torch.compiler.disable
    def _dispatch_token_rows_eager(self, hidden, probs, routing_map):
        return self._send_token_rows(hidden, *self._exchange_token_rows(routing_map, probs))

    def _send_token_rows(self, hidden, token_of_row, row_of_slot, values, input_splits, output_splits,
                         num_expert_rows):
        """Pack the token rows with their tails, exchange them, expand them by local expert: dispatch's result."""
        hidden_size, num_local = hidden.shape[1], self.num_local_experts
        sent_map = RowMap(token_of_row, row_of_slot)
        packed = pack_rows(hidden, values, token_of_row.unsqueeze(1), row_of_slot, compute_dtype(hidden))
        received = all_to_all(packed, output_splits, input_splits, self.ep_group)  # [N, W]

        received_map, value_index, tokens_per_expert = received_row_map(
            packed_values(received, hidden_size, num_local), self.topk, num_expert_rows)
        rows_RH, probs_NL = unpack_rows(received, received_map.token_of_row.unsqueeze(1), received_map.row_of_slot,
                                        hidden_size, num_local)
        probs_R = gather_row_probs(probs_NL, value_index, received_map.token_of_row >= 0)  # unused rows: 0
        meta = AlltoAllDispatchMeta(sent_map, tuple(input_splits), tuple(output_splits), received_map=received_map)
        return rows_RH, tokens_per_expert, probs_R, meta

    def _exchange_token_rows(self, routing_map, probs):
        """The rows to send (a token once per rank holding any of its experts), the count exchange and the host
        sync: ``(token_of_row [N_s], row_of_slot [T, ep], values [N_s, L], input_splits, output_splits, R)``."""
        num_tokens = routing_map.shape[0]
        ep, num_local = self.ep_size, self.num_local_experts
        routing_TRL = routing_map.view(num_tokens, ep, num_local)
        dest_TR = routing_TRL.any(dim=2)  # [T, ep]: token t goes to rank r
        # Per peer: rows for each of its local experts, then the tokens it gets.
        counts_RC = torch.cat([routing_TRL.sum(dim=0), dest_TR.sum(dim=0, keepdim=True).t()], dim=1)
        _, counts_copy = self._exchange_counts(counts_RC.reshape(-1), num_local + 1)
        # Sized for T * ep rows until the host knows N_s: all of it queued before the host waits.
        token_of_row, dest_of_row, row_of_slot = token_rows(dest_TR)
        values = row_probs(routing_map, probs, token_of_row, dest_of_row, ep)  # [T * ep, L]
        host = counts_copy.wait()
        sent_RC, received_RC = host[:ep * (num_local + 1)], host[ep * (num_local + 1):]
        input_splits, output_splits = sent_RC[num_local::num_local + 1], received_RC[num_local::num_local + 1]
        num_sent = sum(input_splits)
        return (token_of_row[:num_sent], row_of_slot, values[:num_sent], input_splits, output_splits,
                sum(received_RC) - sum(output_splits))

    @torch.compiler.disable
    def _dispatch_expert_rows(self, hidden, probs, routing_map):
        num_tokens, hidden_size = hidden.shape
        ep, num_local = self.ep_size, self.num_local_experts
        capacity = self.capacity(num_tokens)
        check = None if capacity is None else TokenCountCheck.start(num_tokens, self.ep_group, hidden.device)
        if capacity is None:
            sent_counts_E = routing_map.sum(dim=0)  # rows this rank sends to each expert, global order
            # received_counts[s * L + e]: rows source rank s sends to local expert e.
            received_counts, counts_copy = self._exchange_counts(sent_counts_E, num_local)
        else:  # static: made where _received_layout reads it, the side stream on CUDA
            received_counts, = on_side_stream(
                lambda: (hidden.new_full((ep * num_local,), capacity, dtype=torch.int64),), hidden.device,
                after_current=False, join=False)
        packed = num_local > 1
        sent, sent_probs, row_map = permute(hidden, routing_map, pack_probs=packed,
                                            **self._permute_kwargs(num_tokens, probs))
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
        if not packed:
            received_probs = all_to_all(sent_probs.float(), output_splits, input_splits, self.ep_group)
            return received, tokens_per_expert_L, received_probs, AlltoAllDispatchMeta(
                row_map, tuple(input_splits), tuple(output_splits))
        received_RH, received_probs = unpack_rows(received, sort_index.unsqueeze(1), unsort_index.unsqueeze(1),
                                                  hidden_size, 1)
        meta = AlltoAllDispatchMeta(row_map, tuple(input_splits), tuple(output_splits), unsort_index=unsort_index,
                                    sort_index=sort_index)
        return received_RH, tokens_per_expert_L, received_probs[:, 0].index_select(0, sort_index), meta

    def _exchange_counts(self, counts: torch.Tensor, per_peer: int) -> tuple[torch.Tensor, CountsCopy]:
        """The counts ``[ep * per_peer]`` (``per_peer`` to each EP rank, in rank order) exchanged, and the host copy
        of ``[counts, received]``.

        On CUDA both run on the dispatcher's side stream after the work queued so far, so the exchange (a
        latency-bound collective) and the copy proceed while the current stream works on; it does not wait.
        """
        splits = [per_peer] * self.ep_size

        def exchange():
            received = all_to_all(counts, splits, splits, self.ep_group)
            return received, CountsCopy(torch.cat([counts, received]))

        return on_side_stream(exchange, counts.device, counts, after_current=True, join=False)


def _received_layout(counts_SL: torch.Tensor, num_rows: int, sort: bool):
    """``(tokens_per_expert [L], sort_index [R] or None, unsort_index [R] or None)`` of expert rows received.

    On CUDA the few dozen tiny kernels run on the dispatcher's side stream, after the count exchange queued there
    and not after the permute or the all-to-all queued on the current stream, so they stay off the critical path;
    the current stream waits for them before their first use.
    """
    def layout():
        indices = (chunk_transpose_index(counts_SL, num_rows), chunk_transpose_index(counts_SL.t(), num_rows))
        return (counts_SL.sum(dim=0), *(indices if sort else (None, None)))

    return on_side_stream(layout, counts_SL.device, counts_SL, after_current=False, join=True)


def _per_rank(counts: list[int], num_local: int) -> list[int]:
    """Sums of consecutive blocks of ``num_local`` counts: rows per EP rank."""
    return [sum(counts[i:i + num_local]) for i in range(0, len(counts), num_local)]


__all__ = ["MoEAlltoAllTokenDispatcher", "AlltoAllDispatchMeta"]
