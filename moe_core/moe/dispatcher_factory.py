"""``build_token_dispatcher``: the dispatcher an ``MoELayer`` uses for its EP size and config.

A module of its own because it imports every dispatcher, and the EP dispatchers import the interface from
``token_dispatcher.py``.
"""

from __future__ import annotations

from moe_core.config import TransformerConfig
from moe_core.moe.token_dispatcher import MoELocalTokenDispatcher, MoETokenDispatcher
from moe_core.moe.token_dispatcher_allgather import MoEAllGatherTokenDispatcher
from moe_core.moe.token_dispatcher_alltoall import MoEAlltoAllTokenDispatcher
from moe_core.parallel.process_groups import ProcessGroupCollection

EP_DISPATCHERS = {"alltoall": MoEAlltoAllTokenDispatcher, "allgather": MoEAllGatherTokenDispatcher}


def build_token_dispatcher(config: TransformerConfig, pg_collection: ProcessGroupCollection | None = None
                           ) -> MoETokenDispatcher:
    """The single-rank dispatcher when EP size is 1, else the one named by ``config.moe_token_dispatcher_type``
    (``alltoall``: the exchange layout the config asks for, ``MoEAlltoAllTokenDispatcher``).

    Args:
        config: num_moe_experts, moe_token_dispatcher_type, capacity fields.
        pg_collection: the EP groups; None: one rank holds every expert.
    Raises:
        ValueError: ``config.num_moe_experts`` is None, or does not split into this rank's block of experts.
    """
    if config.num_moe_experts is None:
        raise ValueError("config.num_moe_experts: a token dispatcher needs experts, got None")
    ep_size = 1 if pg_collection is None else pg_collection.ep_size
    if ep_size == 1:
        return MoELocalTokenDispatcher(config)
    cls = EP_DISPATCHERS[config.moe_token_dispatcher_type]
    return cls(config.num_moe_experts // ep_size, pg_collection.local_expert_indices(config.num_moe_experts),
               config, pg_collection)


__all__ = ["EP_DISPATCHERS", "build_token_dispatcher"]
