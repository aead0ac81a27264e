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
    with pytest.raises(DeadlineExceeded, match=r"ranks \[0\] did not finish within 3 s"):
        run_distributed(2, _rank0_waits_alone, timeout=3)
    assert time.monotonic() - start < 30


def test_harness_reports_a_rank_error():
    from tests.parallel._launch import RankFailure, run_distributed

    with pytest.raises(RankFailure, match="(?s)rank 1.*KeyError: 'boom on rank 1'"):
        run_distributed(2, _rank1_raises)
