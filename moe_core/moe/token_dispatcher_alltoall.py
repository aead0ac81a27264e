"""All-to-all token dispatcher for expert parallelism (Megatron-LM's ``MoEAlltoAllTokenDispatcher``): one class per
exchange layout, and ``MoEAlltoAllTokenDispatcher``, which builds the layout the config asks for
(``moe_token_dispatcher_type: alltoall``).

Legend (docs/design.md): E experts, P EP ranks, L = E / P local experts.

- token rows (``TokenRowsAlltoAllDispatcher``, ``alltoall_token_rows.py``): a token once per EP rank it reaches.
  The default when L > 1.
- sync-free token rows (``SyncFreeTokenRowsAlltoAllDispatcher``, ``alltoall_token_rows.py``): every token to every
  EP rank, static shapes. With ``moe_dispatch_sync_free``.
- expert rows (``ExpertRowsAlltoAllDispatcher``, ``alltoall_expert_rows.py``): a row per (token, expert), Megatron's
  layout. With ``moe_pad_expert_input_to_capacity`` (drop_and_pad: static shapes too, ``moe_dispatch_sync_free`` or
  not), and at L = 1 without ``moe_dispatch_sync_free``.

Each layout's module draws its data flow and lists its collectives, host syncs and streams; each layout has its own
frozen metadata record, holding what its ``combine`` needs.

Every layout hands the experts the same rows in the same order: grouped by local expert, then source rank, then
token index (the all-gather dispatcher's order too). Every rank issues the same collectives in the same order
whatever the routing, a rank sending or receiving nothing included.

Under torch.compile the token rows and the expert rows run eagerly (``torch.compiler.disable``): their split sizes
are host data from the count exchange, which a traced graph would have to take as symbolic sizes (some torch
releases fail to trace them); drop_and_pad's expert rows share that path. The expert compute around them compiles.
The sync-free token rows have static shapes and trace whole: the layer is one graph, its all-to-alls functional
collectives.
"""

from __future__ import annotations

from moe_core.config import TransformerConfig
from moe_core.moe.alltoall_expert_rows import ExpertRowsAlltoAllDispatcher
from moe_core.moe.alltoall_token_rows import SyncFreeTokenRowsAlltoAllDispatcher, TokenRowsAlltoAllDispatcher
from moe_core.moe.token_dispatcher import (
    ExpertParallelTokenDispatcher,
    MoELocalTokenDispatcher,
    MoETokenDispatcher,
    check_local_experts,
)


def alltoall_dispatcher_class(config: TransformerConfig, num_local_experts: int
                              ) -> type[ExpertParallelTokenDispatcher]:
    """The layout class for ``config`` (``moe_pad_expert_input_to_capacity``, ``moe_dispatch_sync_free``) and L =
    ``num_local_experts``: the module docstring's table."""
    if config.moe_pad_expert_input_to_capacity:
        return ExpertRowsAlltoAllDispatcher
    if config.moe_dispatch_sync_free:
        return SyncFreeTokenRowsAlltoAllDispatcher
    return TokenRowsAlltoAllDispatcher if num_local_experts > 1 else ExpertRowsAlltoAllDispatcher


def MoEAlltoAllTokenDispatcher(num_local_experts: int, local_expert_indices: list[int], config: TransformerConfig,
                               pg_collection=None) -> MoETokenDispatcher:
    """Megatron's all-to-all dispatcher by its name and arguments: the layout ``config`` asks for
    (``alltoall_dispatcher_class``), built. ``build_token_dispatcher`` calls it for ``moe_token_dispatcher_type:
    alltoall``; construct a layout class directly for that layout whatever the config.

    At EP size 1 (``pg_collection`` None, or its EP group one rank) no row leaves the rank: a
    ``MoELocalTokenDispatcher``, which hands the experts the same rows.

    Args: see ``ExpertParallelTokenDispatcher``.
    Raises:
        ValueError: ``config.num_moe_experts`` is None; the local experts are not this rank's contiguous block of
            ``num_moe_experts / ep``.
    """
    if pg_collection is None or pg_collection.ep_size == 1:
        local = MoELocalTokenDispatcher(config)
        check_local_experts(num_local_experts, local_expert_indices, local.num_experts, pg_collection)
        return local
    cls = alltoall_dispatcher_class(config, num_local_experts)
    return cls(num_local_experts, local_expert_indices, config, pg_collection)


__all__ = ["MoEAlltoAllTokenDispatcher", "alltoall_dispatcher_class"]
