"""Collectives that fail with an error naming them, instead of the backend's bare message.

Every collective runs under the process group's timeout (``init_distributed(timeout=...)``). When a peer is
stopped or stuck, gloo raises ``RuntimeError("Timed out waiting 300000ms for recv operation to complete")``
and NCCL's watchdog a ``DistBackendError``: neither says which collective of which step was waiting.
``named_collective`` re-raises such a failure as ``CollectiveError`` naming the collective, its group's ranks
and this rank. Nested uses keep the innermost name (the most precise one). Other errors (a shape bug, an
out-of-memory error) pass unchanged, so a block with computation inside may be named too.

For a check that all ranks issue the same collectives with the same shapes, run with
``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch then wraps every process group in its ``ProcessGroupWrapper``,
which compares the op and the tensor shapes over the ranks before each collective and reports a mismatch.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch.distributed as dist

# gloo raises plain RuntimeErrors from its transport; NCCL raises DistBackendError, a DistError.
_GLOO_FAILURE = re.compile(r"gloo/transport|Timed out waiting|Connection (closed|reset) by peer|pair closure")


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer timed out (stuck or stopped), died, or disagreed."""


@contextlib.contextmanager
def named_collective(name: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Re-raise a communication failure in the block as ``CollectiveError`` naming ``name`` and ``group``'s ranks.

    ``name``: the collective and what it is for, e.g. ``"all_reduce (gradient norm)"``. ``group``: its process
    group (``None``: the default group). Any other error passes unchanged.
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        if not dist.is_initialized() or not (isinstance(e, dist.DistError) or _GLOO_FAILURE.search(str(e))):
            raise
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        detail = " ".join(str(e).split())  # one line (DDP's reducer reports over several), so logs end with it
        raise CollectiveError(
            f"rank {dist.get_rank()}: collective {name} over ranks {ranks} did not complete: {detail} (a rank is "
            "stuck, stopped or dead, or ranks issued different collectives; the timeout is init_distributed's, "
            "--distributed-timeout-minutes)"
        ) from e


__all__ = ["CollectiveError", "named_collective"]
