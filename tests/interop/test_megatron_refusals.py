"""What moe_core's Megatron modules refuse, each with a ``ValueError`` naming the argument or config field."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_core.interop.megatron import MoECoreColumnParallelGroupedLinear, MoECoreGroupedMLP  # noqa: E402
from tests.interop._megatron_env import moe_config  # noqa: E402


@pytest.mark.parametrize(("fields", "message"), [
    (dict(expert_tensor_parallel_size=2), "config.expert_tensor_parallel_size: MoECoreGroupedMLP supports 1, got 2"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
     r"config.recompute_modules: MoECoreGroupedMLP does not recompute 'moe_act', got \['moe_act'\]"),
    (dict(moe_ffn_hidden_size=None), "config.moe_ffn_hidden_size: expected an int, got None"),
])
def test_experts_refuse_config(fields, message):
    config = moe_config()
    for name, value in fields.items():  # after __post_init__, which would check them against the world
        setattr(config, name, value)
    with pytest.raises(ValueError, match=message):
        MoECoreGroupedMLP(4, config)


def test_experts_refuse_fp8():
    config = moe_config()
    config.fp8 = "e4m3"
    with pytest.raises(ValueError, match="config.fp8: MoECoreGroupedMLP computes in params_dtype"):
        MoECoreGroupedMLP(4, config)


def linear(*sizes, **kwargs):
    args = dict(config=moe_config(), init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=False,
                is_expert=True)
    return MoECoreColumnParallelGroupedLinear(*sizes, **{**args, **kwargs})


@pytest.mark.parametrize(("sizes", "message"), [
    ((0, 16, 32), "num_local_experts: expected a positive int, got 0"),
    ((4, 16, True), "output_size: expected a positive int, got True"),
])
def test_linear_refuses_sizes(sizes, message):
    with pytest.raises(ValueError, match=message):
        linear(*sizes)


def test_linear_refuses_non_experts():
    with pytest.raises(ValueError, match="is_expert: MoECoreColumnParallelGroupedLinear holds experts only"):
        linear(4, 16, 32, is_expert=False)


def test_experts_name_mismatched_inputs():
    experts = MoECoreGroupedMLP(4, moe_config())
    x, probs = torch.zeros(5, 16, dtype=torch.float64), torch.ones(5)
    with pytest.raises(ValueError, match=r"tokens_per_expert: expected \[4\], got \(3,\)"):
        experts(x, torch.tensor([1, 2, 2]), probs)
    with pytest.raises(ValueError, match=r"permuted_local_hidden_states: expected \[R, 16\], got \(5, 8\)"):
        experts(torch.zeros(5, 8, dtype=torch.float64), torch.tensor([1, 2, 2, 0]), probs)
