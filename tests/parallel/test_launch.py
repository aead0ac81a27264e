"""Start-up without torchrun and the per-DP-rank data shard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_core.parallel.launch import init_distributed, rank_slice


def test_single_process_needs_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(1, num_moe_experts=8) is None


def test_bad_sizes_fail_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(2\) must divide the number of processes"):
        init_distributed(2, num_moe_experts=8)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"num_moe_experts \(6\) must be a positive multiple"):
        init_distributed(4, num_moe_experts=6)


def test_rank_slices_are_distinct_and_cover_the_batch():
    rows = []
    for rank in range(4):
        pg = SimpleNamespace(dp_size=4, dp_rank=rank)
        rows += list(range(12))[rank_slice(12, pg)]
    assert rows == list(range(12))
    assert rank_slice(5, None) == slice(0, 5)
    with pytest.raises(ValueError, match=r"global_batch_size \(10\) must be a multiple of the DP size \(4\)"):
        rank_slice(10, SimpleNamespace(dp_size=4, dp_rank=0))


def _rank0_waits_alone() -> None:
    import torch
    import torch.distributed as dist

    from tests.parallel._launch import device

    if dist.get_rank() == 0:
        x = torch.ones(1, device=device())
        dist.all_reduce(x)  # rank 1 never joins: a hang
        x.cpu()  # NCCL enqueues the collective and returns: wait for it on the host, as a loss.item() would


def _rank1_raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("boom on rank 1")


def test_harness_turns_a_hang_into_a_failure():
    import time

    from tests.parallel._launch import DeadlineExceeded, run_distributed

    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"ranks \[0\] did not finish within 10 s"):
        run_distributed(2, _rank0_waits_alone, timeout=10)
    assert time.monotonic() - start < 30


def test_harness_reports_a_rank_error():
    from tests.parallel._launch import RankFailure, run_distributed

    with pytest.raises(RankFailure, match="(?s)rank 1.*KeyError: 'boom on rank 1'"):
        run_distributed(2, _rank1_raises)


def _subgroup_times_out() -> float:
    import datetime
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from moe_core.parallel.collective_errors import CollectiveError, named_collective
    from tests.parallel._launch import device

    pool_timeout = dist.group.WORLD._get_backend(device()).options._timeout
    pg = init_distributed(2, num_moe_experts=4, timeout=datetime.timedelta(seconds=2))
    try:
        if dist.get_rank() != 0:
            return 0.0
        start = time.monotonic()
        with pytest.raises(CollectiveError, match=r"rank 0: collective all_reduce \(test\) over ranks \[0, 1\] did"):
            with named_collective("all_reduce (test)", pg.ep):
                x = torch.ones(1, device=device())
                dist.all_reduce(x, group=pg.ep)  # rank 1 never joins
                x.cpu()
        return time.monotonic() - start
    finally:
        _set_pg_timeout(pool_timeout, None)  # the pool's default group keeps its own timeout


def test_init_distributed_timeout_reaches_the_expert_groups():
    """DeviceMesh builds the EP groups with torch's default timeout (30 min on gloo): init_distributed sets its
    own on them, so rank 0 fails in seconds when its EP peer never joins."""
    from tests.parallel._launch import BACKEND, run_distributed

    if BACKEND != "gloo":
        pytest.skip("NCCL aborts the communicator on a timeout")
    waited = run_distributed(4, _subgroup_times_out, timeout=60)[0]
    assert waited < 15


def test_timeout_must_be_positive(monkeypatch):
    import datetime

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="timeout: expected a positive timedelta"):
        init_distributed(1, timeout=datetime.timedelta(0))
