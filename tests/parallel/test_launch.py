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


def _check_agreement(field: str | None, value) -> str | None:
    """check_ranks_agree with rank 1's ``field`` of TrainingConfig set to ``value`` (None: equal configs); the
    error each rank raised, or None."""
    import dataclasses

    import torch.distributed as dist

    from moe_core.config import TransformerConfig
    from moe_core.parallel.launch import check_ranks_agree
    from moe_core.training.config import TrainingConfig

    model = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4)
    training = TrainingConfig(lr=1e-3, seed=1, save="ckpt")
    if field is not None and dist.get_rank() == 1:
        training = dataclasses.replace(training, **{field: value})
    try:
        check_ranks_agree(model=model, training=training)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("field, value, shown", [("lr", 2e-3, "lr (training): 0.001 on ranks [0], 0.002 on ranks [1]"),
                                                 ("seed", 2, "seed (training): 1 on ranks [0], 2 on ranks [1]"),
                                                 ("save", "other", 'save (training): "ckpt" on ranks [0], "other" on '
                                                                   "ranks [1]")])
def test_ranks_with_different_configs_fail_on_every_rank(field, value, shown):
    from tests.parallel._launch import run_distributed

    errors = run_distributed(2, _check_agreement, field=field, value=value)
    for rank, error in enumerate(errors):
        assert error == (f"rank {rank}: the ranks were given different run configurations; launch every rank with "
                         f"the same flags and YAML: {shown}")


def test_ranks_with_equal_configs_pass():
    from tests.parallel._launch import run_distributed

    assert run_distributed(2, _check_agreement, field=None, value=None) == [None, None]


def _pretrain_with_lr_of_rank() -> str:
    import torch.distributed as dist

    from moe_core.config import TransformerConfig
    from moe_core.training.config import TrainingConfig
    from moe_core.training.trainer import pretrain
    from tests.parallel._common import groups

    model = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                              expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="different run configurations") as error:
        pretrain(model, TrainingConfig(lr=1e-3 * (1 + dist.get_rank())), pg_collection=groups(2, 4))
    return str(error.value)


def test_pretrain_checks_the_ranks_agree_first():
    """Before any data is read or any model is built, so no rank trains with another's settings."""
    from tests.parallel._launch import run_distributed

    assert all("lr (training): 0.001 on ranks [0], 0.002 on ranks [1]" in e
               for e in run_distributed(2, _pretrain_with_lr_of_rank))
