"""The model's training memory is estimated from the config before anything is allocated: the estimate is exact,
cheap for any num_layers, and setup_training refuses what cannot fit."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.training import memory
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BASE = dict(num_layers=5, hidden_size=16, num_attention_heads=2, seq_length=8)


@pytest.mark.parametrize("config", [
    TransformerConfig.from_yaml(CONFIGS / "tiny.yaml"),
    TransformerConfig.from_yaml(CONFIGS / "deepseek_v3.yaml"),  # 3 dense layers first, a shared expert
    TransformerConfig(**BASE),
    TransformerConfig(**BASE, num_moe_experts=4, moe_layer_freq=2, first_k_dense_replace=1, add_bias_linear=True),
    TransformerConfig(**BASE, num_moe_experts=4, moe_layer_freq=[0, 1, 1, 0, 1], qk_layernorm=True,
                      share_embeddings_and_output_weights=True, moe_shared_expert_intermediate_size=8,
                      moe_shared_expert_gate=True, expert_model_parallel_size=2),
], ids=["tiny", "deepseek_v3", "dense", "freq2_first1_bias", "list_tied_shared_ep2"])
def test_estimate_equals_the_built_model(config):
    with torch.device("meta"):
        whole = GPTModel(config.single_process())
    assert memory.num_parameters(config) == whole.num_parameters()


def test_moe_layer_count_without_a_loop():
    for layers in range(1, 12):
        for freq in range(1, 5):
            for first in range(layers + 1):
                config = TransformerConfig(**{**BASE, "num_layers": layers}, num_moe_experts=4, moe_layer_freq=freq,
                                           first_k_dense_replace=first)
                assert memory.num_moe_layers(config) == sum(config.is_moe_layer(i) for i in range(layers))


def test_two_billion_layers_are_refused_before_allocating():
    config = TransformerConfig(**{**BASE, "num_layers": 2_000_000_000}, num_moe_experts=4)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^model: [\d,]+ parameters \(num_layers 2000000000, .*\) need at least "
                                         r"[\d,.]+ GiB per rank for training \(16 bytes a parameter over 1 ranks\); "
                                         r"cpu has [\d,.]+ GiB available$"):
        setup_training(config, TrainingConfig())
    assert time.monotonic() - start < 5


def test_refuses_exactly_what_cannot_fit(monkeypatch):
    config = TransformerConfig(**BASE, num_moe_experts=4)
    needed = memory.BYTES_PER_PARAMETER * memory.num_parameters(config)
    monkeypatch.setattr(memory, "available_bytes", lambda device: needed - 1)
    with pytest.raises(ValueError, match="need at least"):
        setup_training(config, TrainingConfig())
    monkeypatch.setattr(memory, "available_bytes", lambda device: needed)
    assert setup_training(config, TrainingConfig()).model.num_parameters() * memory.BYTES_PER_PARAMETER == needed


def test_available_bytes_on_the_cpu_is_within_the_ram():
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < memory.available_bytes(torch.device("cpu")) <= ram
