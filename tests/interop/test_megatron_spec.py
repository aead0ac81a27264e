"""The README's recipe: ``with_moe_core_experts`` on Megatron-Core's own spec functions builds a ``GPTModel`` whose
MoE layers hold ``MoECoreGroupedMLP``, dense layers and the given spec unchanged. One harness rank (building
Megatron's modules needs its parallel state); the MoE layers' numbers are the parity tests' job."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402

from moe_core.interop.megatron import MoECoreGroupedMLP, with_moe_core_experts  # noqa: E402
from tests.interop._megatron_env import DEADLINE_S, megatron_state, moe_config  # noqa: E402
from tests.parallel._launch import close_pools, device, run_distributed  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    close_pools()


def _gpt(config, spec) -> GPTModel:
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)


def _layer_recipe() -> None:
    with megatron_state():
        config = moe_config(num_layers=2)
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
        model = _gpt(config, with_moe_core_experts(spec))
        assert [type(layer.mlp.experts) for layer in model.decoder.layers] == [MoECoreGroupedMLP] * 2
        assert all(isinstance(layer.mlp.experts, SequentialMLP) for layer in _gpt(config, spec).decoder.layers)
        moe = model.decoder.layers[1].mlp
        x = torch.randn(8, 2, config.hidden_size, dtype=torch.float64, device=device(), requires_grad=True)
        out, _ = moe(x)
        out.sum().backward()
        assert x.grad is not None and moe.experts.linear_fc2.weight.grad is not None


def _block_recipe() -> None:
    with megatron_state():
        config = moe_config(num_layers=3, moe_layer_freq=[0, 1, 1])  # a dense first layer
        model = _gpt(config, with_moe_core_experts(get_gpt_decoder_block_spec(config, use_transformer_engine=False)))
        kinds = [type(getattr(layer.mlp, "experts", layer.mlp)).__name__ for layer in model.decoder.layers]
        assert kinds == ["MLP", "MoECoreGroupedMLP", "MoECoreGroupedMLP"], kinds


def test_layer_spec_recipe_builds_moe_core_experts():
    run_distributed(1, _layer_recipe, timeout=DEADLINE_S)


def test_block_spec_recipe_replaces_moe_layers_only():
    run_distributed(1, _block_recipe, timeout=DEADLINE_S)


def test_a_spec_without_moe_layer_is_refused():
    with pytest.raises(ValueError, match="spec: expected a Megatron MoELayer or TransformerLayer spec"):
        with_moe_core_experts(get_gpt_layer_local_spec(num_experts=None))
