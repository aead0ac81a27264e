"""Process-group layout (Megatron's: EP ranks contiguous, carved out of DP) and start-up errors."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moe_core.parallel.process_groups import build_process_groups, check_expert_split
from tests.parallel._common import groups
from tests.parallel._launch import RankFailure, device, run_distributed


def _layout(ep: int) -> dict:
    pg = groups(ep)
    return {
        "dp": dist.get_process_group_ranks(pg.dp),
        "ep": dist.get_process_group_ranks(pg.ep),
        "expt_dp": dist.get_process_group_ranks(pg.expt_dp),
        "local_experts": pg.local_expert_indices(8),
        "sizes": (pg.dp_size, pg.ep_size, pg.expt_dp_size, pg.ep_rank, pg.dp_rank),
    }


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_layout_world_4(ep):
    results = run_distributed(4, _layout, ep=ep)
    for rank, got in enumerate(results):
        edp_rank, ep_rank = divmod(rank, ep)
        assert got["dp"] == [0, 1, 2, 3]
        assert got["ep"] == list(range(edp_rank * ep, (edp_rank + 1) * ep))
        assert got["expt_dp"] == list(range(ep_rank, 4, ep))
        num_local = 8 // ep
        assert got["local_experts"] == list(range(ep_rank * num_local, (ep_rank + 1) * num_local))
        assert got["sizes"] == (4, ep, 4 // ep, ep_rank, rank)


def _build(ep, num_moe_experts=None):
    build_process_groups(ep, num_moe_experts=num_moe_experts, device_type=device().type)


@pytest.mark.parametrize("kwargs,message", [
    ({"ep": 3}, r"expert_model_parallel_size \(3\) must be a positive divisor of the world size \(4\)"),
    ({"ep": 0}, r"expert_model_parallel_size \(0\)"),
    ({"ep": 2, "num_moe_experts": 6 + 1}, r"num_moe_experts \(7\) must be a positive multiple"),
])
def test_bad_sizes_fail_at_start_up(kwargs, message):
    # Every rank raises the same ValueError before any collective, so the group never hangs.
    with pytest.raises(RankFailure, match=message):
        run_distributed(4, _build, **kwargs)


def test_needs_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_process_groups(1)


def test_expert_split_check():
    with pytest.raises(ValueError, match=r"num_moe_experts \(6\) must be a positive multiple of .* \(4\)"):
        check_expert_split(6, 4)
    check_expert_split(8, 4)
