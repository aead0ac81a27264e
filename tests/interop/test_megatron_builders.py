"""Megatron-Core's own ``TEGroupedMLP`` with ``linear_fc1`` / ``linear_fc2`` built by moe_core's grouped linears
(Megatron's ``GroupedLinearFc1Builder`` / ``GroupedLinearFc2Builder``), no TransformerEngine, inside Megatron's
``MoELayer``, against Megatron's ``SequentialMLP`` on the same weights (tolerances:
``tests/interop/_megatron_parity.py``). One harness rank, on whichever megatron-core is installed: the pinned one
predates the protocols, but its ``TEGroupedMLP`` builds and calls its linears with the same arguments."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_core.interop.megatron import (  # noqa: E402
    MoECoreColumnParallelGroupedLinear,
    MoECoreRowParallelGroupedLinear,
    sequential_to_grouped_keys,
    te_grouped_mlp_with_moe_core_linears,
)
from tests.interop._megatron_env import DEADLINE_S, megatron_state, moe_config  # noqa: E402
from tests.interop._megatron_parity import assert_layers_agree, megatron_layer_pair  # noqa: E402
from tests.parallel._launch import close_pools, device, run_distributed  # noqa: E402

CASES = {
    "swiglu": {},
    "gelu": dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu),
}


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    close_pools()


def _parity(case: str) -> None:
    with megatron_state():
        torch.manual_seed(0)
        config = moe_config(**CASES[case])
        reference, ours = megatron_layer_pair(config, te_grouped_mlp_with_moe_core_linears(),
                                               sequential_to_grouped_keys)
        assert type(ours.experts).__name__ == "TEGroupedMLP"
        assert isinstance(ours.experts.linear_fc1, MoECoreColumnParallelGroupedLinear)
        assert isinstance(ours.experts.linear_fc2, MoECoreRowParallelGroupedLinear)
        x = torch.randn(6, 2, config.hidden_size, dtype=torch.float64).to(device())
        assert_layers_agree(reference, ours, x)


@pytest.mark.parametrize("case", sorted(CASES))
def test_te_grouped_mlp_on_moe_core_linears_matches_sequential_mlp(case):
    run_distributed(1, _parity, timeout=DEADLINE_S, case=case)
