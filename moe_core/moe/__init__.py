"""Mixture-of-experts layer: router.py (TopKRouter), token_dispatcher*.py and alltoall_*.py (dispatch/combine),
dispatcher_factory.py (build_token_dispatcher), experts.py (GroupedMLP, SequentialMLP), shared_experts.py,
moe_layer.py (MoELayer), metrics.py (routing metrics); data flow in docs/design.md."""

from moe_core.moe.dispatcher_factory import build_token_dispatcher
from moe_core.moe.experts import GroupedMLP, SequentialMLP
from moe_core.moe.moe_layer import MoELayer
from moe_core.moe.router import TopKRouter
from moe_core.moe.shared_experts import SharedExpertMLP
from moe_core.moe.token_dispatcher import MoELocalTokenDispatcher, MoETokenDispatcher
from moe_core.moe.token_dispatcher_allgather import MoEAllGatherTokenDispatcher
from moe_core.moe.token_dispatcher_alltoall import MoEAlltoAllTokenDispatcher

__all__ = [
    "MoELayer", "TopKRouter", "GroupedMLP", "SequentialMLP", "SharedExpertMLP", "MoETokenDispatcher",
    "MoELocalTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoEAllGatherTokenDispatcher", "build_token_dispatcher",
]
