"""``MoECoreGroupedMLP`` in Megatron-Core's ``MoELayer`` at expert parallelism 2 (two harness ranks, gloo on the
CPU; ``MOE_CORE_TEST_BACKEND=nccl`` runs them on two GPUs): parity with Megatron's ``SequentialMLP`` (biases
included), and a rank whose experts get no token completes forward and backward. Under the harness's deadline."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from tests.interop._megatron_env import DEADLINE_S, megatron_state, moe_config  # noqa: E402
from tests.interop._megatron_parity import assert_layers_agree, megatron_layer_pair, record_tokens_per_expert  # noqa: E402,E501
from tests.parallel._launch import close_pools, device, run_distributed  # noqa: E402

CASES = {
    "swiglu": {},
    "gelu-biases": dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu, add_bias_linear=True),
    "swiglu-biases-clamp-offset": dict(add_bias_linear=True, activation_func_clamp_value=0.5, glu_linear_offset=1.0),
}


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    close_pools()


def _ep2_layers(config_overrides: dict):
    torch.manual_seed(0)
    config = moe_config(expert_model_parallel_size=2, **config_overrides)
    return megatron_layer_pair(config)


def _parity(case: str) -> list[int]:
    with megatron_state(expert_model_parallel_size=2):
        reference, ours = _ep2_layers(CASES[case])
        counts = record_tokens_per_expert(ours)
        g = torch.Generator().manual_seed(10 + dist.get_rank())
        x = torch.randn(6, 2, reference.config.hidden_size, generator=g, dtype=torch.float64).to(device())
        assert_layers_agree(reference, ours, x)
        return counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_ep2_matches_sequential_mlp(case):
    counts = run_distributed(2, _parity, timeout=DEADLINE_S, case=case)
    assert all(sum(c) > 0 for c in counts), counts  # both ranks' experts compute


def _rank1_gets_no_tokens() -> list[int]:
    with megatron_state(expert_model_parallel_size=2):
        reference, ours = _ep2_layers({})
        # Feature 0 of every token is 1 and rank 1's experts (4..7) score -100 on it: the top-2 are on rank 0.
        with torch.no_grad():
            for layer in (reference, ours):
                layer.router.weight[4:, 0] = -100.0
        counts = record_tokens_per_expert(ours)
        g = torch.Generator().manual_seed(10 + dist.get_rank())
        x = torch.randn(6, 2, reference.config.hidden_size, generator=g, dtype=torch.float64)
        x[..., 0] = 1.0
        assert_layers_agree(reference, ours, x.to(device()))
        if dist.get_rank() == 1:
            for linear in (ours.experts.linear_fc1, ours.experts.linear_fc2):
                assert torch.equal(linear.weight.grad, torch.zeros_like(linear.weight))
        return counts


def test_ep2_rank_without_tokens_completes_forward_and_backward():
    counts = run_distributed(2, _rank1_gets_no_tokens, timeout=DEADLINE_S)
    assert sum(counts[0]) == 2 * 2 * 12 and counts[1] == [0, 0, 0, 0], counts  # both ranks' 12 tokens x top-2
