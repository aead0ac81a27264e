"""All-to-all token dispatcher for expert parallelism (Megatron-LM's ``MoEAlltoAllTokenDispatcher``).

Legend (docs/design.md): T this rank's tokens, H hidden, E experts, L = E / ep local experts, K topk,
R_s rows this rank sends (T * K before dropping), R rows this rank's experts receive, C capacity,
W = ``packed_width(H)`` columns of a packed row (``moe_core.ops.permute``).

dispatch:  exchange the per-expert counts (all-to-all of E ints), start copying them to the host
           permute [T, H] and probs -> packed rows [R_s, W] in the send buffer, rank-major then local-expert-major
           (global expert order), one gather
           wait for the counts on the host                       (the host sync, see below)
           all_to_all of the packed rows                         -> [R, W] grouped by (source rank, local expert)
           one gather by a device-computed index sorts and unpacks -> [R, H] and probs [R], grouped by
           (local expert, source rank)
combine:   one gather back to (source rank, local expert) order -> reverse all_to_all -> unpermute (gather-sum)
           -> [T, H]

With one local expert (L = 1) the rows arrive sorted: rows and probs travel apart in two all-to-alls and
neither side gathers (unpacking alone would cost a pass over the rows, more than the small second collective).

Every rank issues the same collectives in the same order whatever the routing, including a rank that sends or
receives zero rows: in dispatch the count exchange (without drop_and_pad) and the rows' all-to-all (plus the
probs' one when L = 1), in combine one all-to-all, and their mirrors in backward.

Host syncs: with ``drop_and_pad`` the split sizes are static and there is none. Otherwise exactly one per
dispatch (Megatron's ``preprocess`` has the same): ``all_to_all_single`` takes its split sizes as host ints, so
the exchanged counts must reach the host (``_CountsCopy.wait``). Backward needs no host data beyond the same
splits.

Streams (CUDA): the count exchange and its copy to pinned host memory run on a side stream
(``moe_utils.side_stream(device, "dispatch")``) that waits for the routing only, so they proceed while the
current stream permutes, and the host's wait blocks on that copy's event, not on the permute. The sort indices
are computed from the received counts on the same side stream while the rows' all-to-all is in flight; the
current stream waits for them (an event) before the gather. Off CUDA everything runs in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_core.moe.moe_utils import RowMap, permute, side_stream, unpermute
from moe_core.moe.token_dispatcher import ExpertParallelTokenDispatcher, check_dispatch_inputs
from moe_core.ops.permute import permute_rows, unpermute_rows_packed
from moe_core.parallel.collectives import all_to_all


@dataclass(frozen=True)
class AlltoAllDispatchMeta:
    """What ``combine`` needs to undo ``dispatch``.

    Attributes:
        row_map: the ``moe_utils.RowMap`` of this rank's tokens and the rows it sends (from ``permute``).
        input_splits / output_splits: rows sent to / received from each EP rank (host ints).
        unsort_index: ``[R]`` int64 on the device, the expert-major row each (source rank, local expert)-major
            row came from (combine's gather); None when L = 1 or EP = 1.
        sort_index: ``[R]`` int64, the inverse permutation (the unsort's backward); None likewise.
    """

    row_map: RowMap
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    unsort_index: torch.Tensor | None
    sort_index: torch.Tensor | None


def chunk_transpose_index(counts_AB: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The gather index that reorders rows held in chunks (a, b), a-major, into b-major chunk order.

    Megatron's ``sort_chunks_by_idxs`` for the chunk grid of an all-to-all, as one index: ``rows[index]`` lists
    chunk (0, 0), (1, 0), ..., (A-1, 0), (0, 1), ... with each chunk's rows in their order. Computed on the
    device (no host sync).

    Args:
        counts_AB: ``[A, B]`` int64, the rows of chunk (a, b).
        num_rows: their sum (a host int, so the output's size needs no sync).
    Returns:
        ``[num_rows]`` int64 on counts' device, a permutation of ``range(num_rows)``.
    """
    num_a, num_b = counts_AB.shape
    device = counts_AB.device
    counts_ab = counts_AB.reshape(-1)
    start_ab = counts_ab.cumsum(0) - counts_ab  # where chunk (a, b) starts in the a-major source
    counts_ba = counts_AB.t().reshape(-1)
    start_ba = counts_ba.cumsum(0) - counts_ba  # where chunk (a, b) starts in the b-major output
    chunk = torch.repeat_interleave(torch.arange(num_a * num_b, device=device), counts_ba, output_size=num_rows)
    shift = start_ab.view(num_a, num_b).t().reshape(-1) - start_ba  # per b-major chunk id
    return torch.arange(num_rows, device=device) + shift[chunk]


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
        num_tokens, hidden_size = hidden.shape
        ep, num_local = self.ep_size, self.num_local_experts
        capacity = self.capacity(num_tokens)
        permute_kwargs = dict(probs=probs, num_out_tokens=self.num_out_tokens(num_tokens),
                              drop_and_pad=self.drop_and_pad, num_slots=None if self.drop_and_pad else self.topk)
        if ep == 1:
            sent, sent_probs, row_map = permute(hidden, routing_map, **permute_kwargs)
            counts_L = routing_map.sum(dim=0) if capacity is None else torch.full(
                (num_local,), capacity, dtype=torch.int64, device=hidden.device)
            return sent, counts_L, sent_probs.float(), AlltoAllDispatchMeta(row_map, (), (), None, None)

        if capacity is None:
            received_counts, counts_copy = self._exchange_counts(routing_map.sum(dim=0))
        else:  # static: made where _received_layout reads it, the side stream on CUDA
            received_counts, = _on_side_stream(
                lambda: (hidden.new_full((ep * num_local,), capacity, dtype=torch.int64),), hidden.device,
                after_current=False, join=False)
        packed = num_local > 1
        sent, sent_probs, row_map = permute(hidden, routing_map, pack_probs=packed, **permute_kwargs)
        if capacity is None:
            host_counts = counts_copy.wait()
            input_splits = _per_rank(host_counts[:self.num_experts], num_local)
            output_splits = _per_rank(host_counts[self.num_experts:], num_local)
        else:
            input_splits = output_splits = [num_local * capacity] * ep
        received = all_to_all(sent, output_splits, input_splits, self.ep_group)
        tokens_per_expert_L, sort_index, unsort_index = _received_layout(
            received_counts.view(ep, num_local), sum(output_splits), packed)
        if not packed:
            received_probs = all_to_all(sent_probs.float(), output_splits, input_splits, self.ep_group)
            return received, tokens_per_expert_L, received_probs, AlltoAllDispatchMeta(
                row_map, tuple(input_splits), tuple(output_splits), None, None)
        received_RH, received_probs = unpermute_rows_packed(received, unsort_index, sort_index.unsqueeze(1),
                                                            hidden_size)
        meta = AlltoAllDispatchMeta(row_map, tuple(input_splits), tuple(output_splits), unsort_index, sort_index)
        return received_RH, tokens_per_expert_L, received_probs.index_select(0, sort_index), meta

    def _exchange_counts(self, sent_counts_E: torch.Tensor) -> tuple[torch.Tensor, _CountsCopy]:
        """``received_counts [ep * L]`` (entry ``s * L + e``: rows source rank s sends to local expert e) and the
        host copy of ``[sent_counts_E, received_counts]``.

        On CUDA both run on the dispatcher's side stream after the work queued so far, so the exchange (a
        latency-bound collective) and the copy run alongside the permute; the current stream does not wait.
        """
        ep, num_local = self.ep_size, self.num_local_experts

        def exchange():
            received = all_to_all(sent_counts_E, [num_local] * ep, [num_local] * ep, self.ep_group)
            return received, _CountsCopy(torch.cat([sent_counts_E, received]))

        return _on_side_stream(exchange, sent_counts_E.device, sent_counts_E, after_current=True, join=False)

    def combine(self, expert_output: torch.Tensor, meta: AlltoAllDispatchMeta) -> torch.Tensor:
        """Return ``expert_output`` [R, H] rows to their source ranks and sum each token's rows into ``[T, H]``.

        Probs were applied inside the experts, so this is a pure sum over each token's rows.
        """
        out = expert_output  # [R, H], then [R_s, H] once back on this rank
        if self.ep_size > 1:
            if meta.unsort_index is not None:
                out = permute_rows(out, meta.unsort_index, meta.sort_index.unsqueeze(1))
            out = all_to_all(out, meta.input_splits, meta.output_splits, self.ep_group)
        return unpermute(out, meta.row_map)


def _received_layout(counts_SL: torch.Tensor, num_rows: int, sort: bool):
    """``(tokens_per_expert [L], sort_index [R] or None, unsort_index [R] or None)`` of the received rows.

    On CUDA the few dozen tiny kernels run on the dispatcher's side stream, after the count exchange queued there
    and not after the permute or the all-to-all queued on the current stream, so they stay off the critical path;
    the current stream waits for them before their first use.
    """
    def layout():
        indices = (chunk_transpose_index(counts_SL, num_rows), chunk_transpose_index(counts_SL.t(), num_rows))
        return (counts_SL.sum(dim=0), *(indices if sort else (None, None)))

    return _on_side_stream(layout, counts_SL.device, counts_SL, after_current=False, join=True)


@torch.compiler.disable
def _on_side_stream(fn, device: torch.device, *inputs: torch.Tensor, after_current: bool, join: bool) -> tuple:
    """``fn()`` on ``device``'s side stream ``"dispatch"`` (in place off CUDA); returns its outputs, a tuple.

    ``inputs``: the tensors ``fn`` reads, kept from reuse until the side stream has read them. ``after_current``:
    the side stream first waits for the work queued so far on the current stream (else only for its own earlier
    work). ``join``: the current stream waits for ``fn``'s kernels, and its tensor outputs are recorded as used
    there (allocated on the side stream, they must outlive the side stream's next work).
    """
    if device.type != "cuda":
        return fn()
    main, side = torch.cuda.current_stream(device), side_stream(device, "dispatch")
    if after_current:
        side.wait_stream(main)
    with torch.cuda.stream(side):
        outputs = fn()
    for tensor in inputs:
        tensor.record_stream(side)
    if join:
        main.wait_stream(side)
        for out in outputs:
            if isinstance(out, torch.Tensor):
                out.record_stream(main)
    return outputs


def _per_rank(counts: list[int], num_local: int) -> list[int]:
    """Sums of consecutive blocks of ``num_local`` counts: rows per EP rank."""
    return [sum(counts[i:i + num_local]) for i in range(0, len(counts), num_local)]


class _CountsCopy:
    """A device->host copy of int64 counts, queued at construction, waited for by ``wait``.

    On CUDA the copy goes to pinned memory behind the work already queued on the current stream and records an
    event; ``wait`` blocks the host on that event only, not on work queued after the copy. On the CPU it is the
    tensor itself. Run eagerly under ``torch.compile`` (a host sync cannot be traced).
    """

    @torch.compiler.disable
    def __init__(self, counts: torch.Tensor):
        self._event = None
        if counts.is_cuda:
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = counts

    @torch.compiler.disable
    def wait(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


__all__ = ["MoEAlltoAllTokenDispatcher", "AlltoAllDispatchMeta", "chunk_transpose_index"]
