"""MoEAlltoAllTokenDispatcher picks the exchange layout from the config (the layouts' exchanges themselves run in
tests/parallel/test_dispatchers.py), and at EP size 1 is the single-rank dispatcher."""

from types import SimpleNamespace

import pytest

from moe_core.config import TransformerConfig
from moe_core.moe.alltoall_expert_rows import ExpertRowsAlltoAllDispatcher
from moe_core.moe.alltoall_token_rows import SyncFreeTokenRowsAlltoAllDispatcher, TokenRowsAlltoAllDispatcher
from moe_core.moe.dispatcher_factory import build_token_dispatcher
from moe_core.moe.token_dispatcher import MoELocalTokenDispatcher
from moe_core.moe.token_dispatcher_alltoall import MoEAlltoAllTokenDispatcher, alltoall_dispatcher_class

CAPACITY = {None: {}, "drop": {"moe_expert_capacity_factor": 1.0},
            "pad": {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}}


def make_config(num_experts: int = 8, ep: int = 2, capacity: str | None = None, sync_free: bool = False
                ) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=num_experts,
                             moe_router_topk=1, expert_model_parallel_size=ep, moe_dispatch_sync_free=sync_free,
                             **CAPACITY[capacity])


@pytest.mark.parametrize("capacity,sync_free,num_local,expected", [
    (None, False, 4, TokenRowsAlltoAllDispatcher),
    ("drop", False, 4, TokenRowsAlltoAllDispatcher),
    (None, False, 1, ExpertRowsAlltoAllDispatcher),
    ("drop", False, 1, ExpertRowsAlltoAllDispatcher),
    (None, True, 4, SyncFreeTokenRowsAlltoAllDispatcher),
    ("drop", True, 4, SyncFreeTokenRowsAlltoAllDispatcher),
    (None, True, 1, SyncFreeTokenRowsAlltoAllDispatcher),
    ("pad", False, 4, ExpertRowsAlltoAllDispatcher),
    ("pad", True, 4, ExpertRowsAlltoAllDispatcher),
    ("pad", False, 1, ExpertRowsAlltoAllDispatcher),
])
def test_the_config_picks_the_layout(capacity, sync_free, num_local, expected):
    config = make_config(num_experts=2 * num_local, capacity=capacity, sync_free=sync_free)
    assert alltoall_dispatcher_class(config, num_local) is expected
    # The factory builds it for moe_token_dispatcher_type "alltoall" (no collective runs at construction).
    pg = SimpleNamespace(ep=None, ep_size=2, ep_rank=1, local_expert_indices=lambda e: list(range(e // 2, e)))
    assert type(build_token_dispatcher(config, pg)) is expected
    dispatcher = MoEAlltoAllTokenDispatcher(num_local, list(range(num_local, 2 * num_local)), config, pg)
    assert type(dispatcher) is expected and dispatcher.local_expert_indices == list(range(num_local, 2 * num_local))


def test_at_ep_size_one_no_row_leaves_the_rank():
    config = make_config(ep=1)
    assert type(MoEAlltoAllTokenDispatcher(8, list(range(8)), config)) is MoELocalTokenDispatcher
    with pytest.raises(ValueError, match=r"local_expert_indices: expected \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        MoEAlltoAllTokenDispatcher(8, list(range(1, 9)), config)
    with pytest.raises(ValueError, match="config.num_moe_experts: a token dispatcher needs experts, got None"):
        MoEAlltoAllTokenDispatcher(8, list(range(8)), TransformerConfig(num_layers=1, hidden_size=8,
                                                                        num_attention_heads=2))
