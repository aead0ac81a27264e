"""named_collective turns communication failures into errors naming the collective, and nothing else."""

from __future__ import annotations

import pytest

from moe_core.parallel.collective_errors import named_collective
from tests.parallel._launch import run_distributed


def _classify() -> list[str]:
    import torch.distributed as dist

    seen = []
    for error in (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"),
                  dist.DistBackendError("NCCL watchdog: collective timed out"),
                  RuntimeError("mat1 and mat2 shapes cannot be multiplied"), KeyError("not a RuntimeError")):
        try:
            with named_collective("all_reduce (test)"):
                raise error
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            seen.append(f"{type(e).__name__}: {e}")
    return seen


def test_only_communication_failures_are_renamed():
    seen = run_distributed(2, _classify)[1]
    assert seen[0].startswith("CollectiveError: rank 1: collective all_reduce (test) over ranks [0, 1] did not "
                              "complete: [gloo/transport")
    assert seen[1].startswith("CollectiveError: rank 1: collective all_reduce (test) over ranks [0, 1]")
    assert seen[2:] == ["RuntimeError: mat1 and mat2 shapes cannot be multiplied", "KeyError: 'not a RuntimeError'"]


def test_without_a_process_group_nothing_is_renamed():
    with pytest.raises(RuntimeError, match="^Timed out waiting"):
        with named_collective("all_reduce (test)"):
            raise RuntimeError("Timed out waiting 5000ms")
