"""Process-group layout (Megatron's: TP ranks innermost, then EP; EP carved out of DP x TP) and start-up
errors."""

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


def _ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _tp_layout(tp: int, ep: int, etp: int) -> dict:
    pg = groups(ep, 8, tp, etp)
    return {"tp": _ranks(pg.tp), "dp": _ranks(pg.dp), "ep": _ranks(pg.ep), "expt_dp": _ranks(pg.expt_dp),
            "expt_tp": _ranks(pg.expt_tp), "tp_dp": _ranks(pg.tp_dp),
            "sizes": (pg.tp_size, pg.tp_rank, pg.dp_size, pg.dp_rank, pg.expt_tp_size, pg.ep_size, pg.expt_dp_size),
            "tp_mesh": pg.tp_mesh.mesh_dim_names, "dp_mesh": pg.dp_mesh.mesh_dim_names,
            "expt_tp_mesh": None if pg.expt_tp_mesh is None else pg.expt_tp_mesh.mesh_dim_names}


@pytest.mark.parametrize("tp,ep,etp", [(2, 2, 1), (2, 4, 1), (2, 2, 2), (4, 1, 4)])
def test_tensor_parallel_layout_world_4(tp, ep, etp):
    """Dense: rank = dp_rank * tp + tp_rank. Experts: rank = (expt_dp_rank * ep + ep_rank) * etp + etp_rank,
    so with ETP = TP the ETP groups are the TP groups, and with ETP 1 the EP groups span TP ranks."""
    results = run_distributed(4, _tp_layout, tp=tp, ep=ep, etp=etp)
    for rank, got in enumerate(results):
        dp_rank, tp_rank = divmod(rank, tp)
        assert got["tp"] == list(range(dp_rank * tp, (dp_rank + 1) * tp))
        assert got["dp"] == list(range(tp_rank, 4, tp))
        rest, etp_rank = divmod(rank, etp)
        edp_rank, ep_rank = divmod(rest, ep)
        assert got["expt_tp"] == (None if etp == 1 else list(range(rest * etp, (rest + 1) * etp)))
        assert got["ep"] == [(edp_rank * ep + e) * etp + etp_rank for e in range(ep)]
        assert got["expt_dp"] == [(d * ep + ep_rank) * etp + etp_rank for d in range(4 // (ep * etp))]
        assert got["tp_dp"] == [0, 1, 2, 3]
        assert got["sizes"] == (tp, tp_rank, 4 // tp, dp_rank, etp, ep, 4 // (ep * etp))
        assert (got["tp_mesh"], got["dp_mesh"]) == (("tp",), ("dp",))
        assert got["expt_tp_mesh"] == (None if etp == 1 else ("expt_tp",))


def _build(ep, num_moe_experts=None, tp=1, etp=None):
    build_process_groups(ep, tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
                         num_moe_experts=num_moe_experts, device_type=device().type)


@pytest.mark.parametrize("kwargs,message", [
    ({"ep": 3}, r"expert_model_parallel_size \(3\) must be a positive divisor of the world size \(4\)"),
    ({"ep": 0}, r"expert_model_parallel_size \(0\)"),
    ({"ep": 2, "num_moe_experts": 6 + 1}, r"num_moe_experts \(7\) must be a positive multiple"),
    ({"ep": 1, "tp": 3}, r"tensor_model_parallel_size \(3\) must divide the world size \(4\)"),
    ({"ep": 4, "tp": 2}, r"expert_model_parallel_size \(4\) x expert_tensor_parallel_size \(2\) must be a "
                         r"positive divisor of the world size \(4\)"),
    ({"ep": 1, "tp": 2, "etp": 4}, r"expert_tensor_parallel_size: expected 1 or tensor_model_parallel_size \(2\)"),
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
