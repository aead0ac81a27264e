"""Counts the EP dispatchers exchange and read on the host: each such read is an event wait on a copy queued early,
never an implicit device sync, so the work queued after the copy overlaps it.

Legend (docs/design.md): T this rank's tokens, E experts, P EP ranks.

Layouts with static split sizes (the sync-free token rows, drop_and_pad's expert rows) need the same T on every EP
rank: a rank passing another T would send rows its peers do not expect (a hang, or on gloo an abort). In eager
mode ``TokenCountCheck`` exchanges T first and raises on every rank, naming each rank's T; traced (torch.compile)
or captured in a CUDA graph, the shapes are fixed when the graph is made and nothing is exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_core.moe.moe_utils import side_stream
from moe_core.parallel.collectives import all_gather_first_dim, all_to_all, group_size


@torch.compiler.disable
def on_side_stream(fn, device: torch.device, *inputs: torch.Tensor, after_current: bool, join: bool) -> tuple:
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


class CountsCopy:
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
    def wait(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def gather_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> CountsCopy:
    """Every EP rank's ``counts`` ``[n]`` int64 (one all-gather), as a ``CountsCopy`` whose ``wait`` gives
    ``[ep][n]`` host ints in rank order. On CUDA the exchange runs on the dispatcher's side stream, after the work
    queued so far on the current stream (which made ``counts``)."""
    def exchange():
        return (CountsCopy(all_gather_first_dim(counts.unsqueeze(0), group)),)

    copy, = on_side_stream(exchange, counts.device, counts, after_current=True, join=False)
    return copy


def exchange_counts(counts: torch.Tensor, per_peer: int, group: dist.ProcessGroup | None
                    ) -> tuple[torch.Tensor, CountsCopy]:
    """Send ``counts`` ``[P * per_peer]`` int64 (``per_peer`` for each EP rank, in rank order) with one all-to-all.

    Returns:
        ``(received [P * per_peer], copy)``: the counts each EP rank sent this one, in rank order, on counts'
        device, and a ``CountsCopy`` whose ``wait`` gives ``[*counts, *received]`` as host ints.

    On CUDA both run on the dispatcher's side stream after the work queued so far on the current stream, so the
    exchange (a latency-bound collective) and the copy proceed while the current stream works on; nothing here waits.
    """
    splits = [per_peer] * group_size(group)

    def exchange():
        received = all_to_all(counts, splits, splits, group)
        return received, CountsCopy(torch.cat([counts, received]))

    return on_side_stream(exchange, counts.device, counts, after_current=True, join=False)


def same_token_counts(token_counts: list[int], layout: str) -> None:
    """Raise ``ValueError`` unless every EP rank passed the same T (``token_counts``, in rank order; ``layout``
    names what needs it). Every rank holds the same counts, so every rank raises."""
    if len(set(token_counts)) > 1:
        raise ValueError(f"hidden: {layout} needs the same number of tokens on every EP rank, got "
                         f"{token_counts} tokens on EP ranks 0..{len(token_counts) - 1}")


class TokenCountCheck:
    """The check of the module docstring, in two halves: construction queues the exchange of this rank's T (before
    the work that does not depend on it), ``verify`` waits for it and raises on a mismatch.

    ``start`` returns None where no check is made: while tracing or capturing a CUDA graph, or at EP size 1.
    """

    def __init__(self, num_tokens: int, group: dist.ProcessGroup, device: torch.device):
        # T is made on the side stream itself, so the exchange waits for no work of the current stream.
        def exchange():
            local = torch.full((1, 1), num_tokens, dtype=torch.int64, device=device)
            return (CountsCopy(all_gather_first_dim(local, group)),)

        self._copy, = on_side_stream(exchange, device, after_current=False, join=False)

    @classmethod
    def start(cls, num_tokens: int, group: dist.ProcessGroup | None, device: torch.device) -> TokenCountCheck | None:
        if torch.compiler.is_compiling() or group is None or dist.get_world_size(group) == 1:
            return None
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        return cls(num_tokens, group, device)

    def verify(self, layout: str) -> None:
        """Wait for the exchange; raise ``ValueError`` (see ``same_token_counts``) unless the ranks agree."""
        same_token_counts([row[0] for row in self._copy.wait()], layout)


__all__ = ["on_side_stream", "CountsCopy", "gather_counts", "exchange_counts", "same_token_counts", "TokenCountCheck"]
