"""``MoECoreGroupedMLP`` inside Megatron-Core's own ``MoELayer`` (its ``TopKRouter`` and all-to-all dispatcher)
against Megatron's ``SequentialMLP`` on the same weights, on one rank (a harness process, so Megatron's parallel
state and CPU stand-ins end with the test). Tolerances: ``tests/interop/_megatron_parity.py``.

Megatron's ``SequentialMLP`` with biases fails at EP = 1 and TP = 1 (its fc2 adds the bias in place to a view
``_ReduceFromModelParallelRegion`` returns), so biases are compared at EP = 2 (``test_megatron_ep.py``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.interop._megatron_env import DEADLINE_S, megatron_state, moe_config  # noqa: E402
from tests.interop._megatron_parity import assert_layers_agree, megatron_layer_pair, record_tokens_per_expert  # noqa: E402,E501
from tests.parallel._launch import close_pools, device, run_distributed  # noqa: E402

CASES = {
    "swiglu": {},  # the fused SwiGLU
    "gelu": dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu),
    "swiglu-clamp-offset": dict(activation_func_clamp_value=0.5, glu_linear_offset=1.0),
    "probs-on-input-top1": dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True),
    "32-experts-top4": dict(num_moe_experts=32, moe_router_topk=4),  # 12 tokens: some experts get none
}


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    close_pools()


def _parity(case: str) -> list[int]:
    with megatron_state():
        torch.manual_seed(0)
        config = moe_config(**CASES[case])
        reference, ours = megatron_layer_pair(config)
        counts = record_tokens_per_expert(ours)
        x = torch.randn(6, 2, config.hidden_size, dtype=torch.float64).to(device())  # [S, B, H]
        assert_layers_agree(reference, ours, x)
        return counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_moe_layer_matches_sequential_mlp(case):
    counts = run_distributed(1, _parity, timeout=DEADLINE_S, case=case)[0]
    if case == "32-experts-top4":
        assert 0 in counts, counts  # the case covers experts without tokens
