"""``MoECoreColumnParallelGroupedLinear`` / ``MoECoreRowParallelGroupedLinear`` on their own, as Megatron's
``TEGroupedMLP`` builds and calls them: a Python list of counts, the bias added or handed back, per-expert
init, Megatron's parameter attributes and its gradient-accumulation fusion into ``main_grad``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_core.interop.megatron import MoECoreColumnParallelGroupedLinear, MoECoreRowParallelGroupedLinear  # noqa: E402
from tests.interop._megatron_env import moe_config  # noqa: E402

L, IN, OUT = 3, 5, 7  # local experts, input width, output width
COUNTS = [2, 0, 4]


def linear(cls=MoECoreColumnParallelGroupedLinear, config=None, **kwargs):
    torch.manual_seed(0)
    args = dict(config=config or moe_config(), init_method=torch.nn.init.normal_, bias=True, skip_bias_add=False,
                is_expert=True)
    module = cls(L, IN, OUT, **{**args, **kwargs})
    if module.bias is not None:
        with torch.no_grad():
            module.bias.normal_()
    return module


def per_expert(module, x):
    """``x_e @ W_e^T`` row block by row block, and the bias rows, from Megatron's [out, in] expert weights."""
    blocks = x.split(COUNTS)
    out = torch.cat([b @ module.weight[e].t() for e, b in enumerate(blocks)])
    bias = torch.cat([module.bias[e].expand(n, OUT) for e, n in enumerate(COUNTS)])
    return out, bias


@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_forward_takes_megatrons_list_of_counts(skip_bias_add):
    module = linear(skip_bias_add=skip_bias_add)
    x = torch.randn(sum(COUNTS), IN, dtype=torch.float64)
    out, bias = module(x, COUNTS)
    expected, bias_rows = per_expert(module, x)
    if skip_bias_add:
        assert bias is module.bias  # [L, OUT]: TEGroupedMLP adds row block e's bias * probs itself
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    else:
        assert bias is None
        torch.testing.assert_close(out, expected + bias_rows, rtol=1e-12, atol=1e-12)


def test_each_expert_is_initialised_as_one_megatron_weight():
    shapes = []
    module = linear(init_method=lambda w: shapes.append(tuple(w.shape)) or torch.nn.init.ones_(w))
    assert shapes == [(OUT, IN)] * L and torch.equal(module.weight, torch.ones(L, OUT, IN, dtype=torch.float64))


@pytest.mark.parametrize(("cls", "partition_dim", "bias_partitioned"), [
    (MoECoreColumnParallelGroupedLinear, 1, True), (MoECoreRowParallelGroupedLinear, 2, False)])
@pytest.mark.parametrize("ep", [1, 2])
def test_parameters_carry_megatrons_attributes(cls, partition_dim, bias_partitioned, ep):
    config = moe_config()
    config.expert_model_parallel_size = ep
    module = linear(cls, config)
    assert module.weight.partition_dim == partition_dim and module.weight.tensor_model_parallel
    assert module.bias.tensor_model_parallel is bias_partitioned
    # allreduce False: Megatron's DDP reduces the gradient over the expert-data-parallel group.
    assert module.weight.allreduce is module.bias.allreduce is (ep == 1)


def test_gradient_accumulation_fusion_adds_into_main_grad():
    config = moe_config()
    config.gradient_accumulation_fusion = True
    module = linear(config=config, bias=False)
    module.weight.main_grad = torch.ones(L, OUT, IN, dtype=torch.float32)
    x = torch.randn(sum(COUNTS), IN, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(sum(COUNTS), OUT, dtype=torch.float64)
    module(x, COUNTS)[0].backward(dy)
    blocks, dy_blocks = x.detach().split(COUNTS), dy.split(COUNTS)
    wgrad = torch.stack([dy_blocks[e].t() @ blocks[e] for e in range(L)])  # [L, OUT, IN]
    torch.testing.assert_close(module.weight.main_grad, 1 + wgrad.float(), rtol=1e-6, atol=1e-6)
    assert module.weight.grad_added_to_main_grad and torch.equal(module.weight.grad, torch.zeros(L, OUT, IN,
                                                                                                dtype=torch.float64))
