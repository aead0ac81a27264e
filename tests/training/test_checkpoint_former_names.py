"""A checkpoint whose ``GroupedMLP`` linears are named ``fc1`` / ``fc2`` loads into ``linear_fc1`` /
``linear_fc2``: a resume and a weights-only load of ``tests/data/checkpoint_grouped_fc1_fc2`` (saved at step 2
before the rename) give every parameter and AdamW moment the value saved, read here on its own through DCP's
converter to a plain ``torch.save`` file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from moe_core.config import TransformerConfig
from moe_core.training.checkpoint import load_checkpoint, load_model_weights
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training

CHECKPOINT = Path(__file__).resolve().parents[1] / "data" / "checkpoint_grouped_fc1_fc2"
# What the checkpoint was saved with.
MODEL = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                          moe_ffn_hidden_size=8, add_bias_linear=True, moe_layer_freq=[0, 1], ffn_hidden_size=32,
                          vocab_size=64, seq_length=8)
TRAINING = TrainingConfig(seed=7, lr=1e-3, micro_batch_size=2, train_iters=4)
EXPERTS = "decoder.layers.1.mlp.experts"
RENAMED = {f"{EXPERTS}.linear_fc{i}.{p}": f"{EXPERTS}.fc{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The checkpoint's tensors by their saved keys: ``{"model": {...}, "optim": {"state": {...}}}``."""
    path = tmp_path_factory.mktemp("saved") / "checkpoint.pt"
    dcp_to_torch_save(CHECKPOINT / "step_2", path)
    return torch.load(path, weights_only=True)


def _saved_as(saved: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """The saved tensor of parameter ``name`` in ``like``'s shape (a gated fc1 is saved with a [gate, up] axis)."""
    return saved[RENAMED.get(name, name)].reshape(like.shape)


def test_the_checkpoint_holds_the_former_names_only(saved):
    keys = set(saved["model"])
    assert set(RENAMED.values()) <= keys and not set(RENAMED) & keys


def test_resume_reads_the_former_names(saved):
    state = setup_training(MODEL, TRAINING)
    before = state.model.get_parameter(f"{EXPERTS}.linear_fc1.weight").detach().clone()
    step = load_checkpoint(CHECKPOINT, state.model, state.optimizer, state.scheduler, seed=TRAINING.seed,
                           model_config=MODEL)
    assert step == 2
    params = dict(state.model.named_parameters())
    assert set(RENAMED) <= set(params)
    assert not torch.equal(params[f"{EXPERTS}.linear_fc1.weight"], before)  # the load replaced the fresh init
    for name, param in params.items():
        assert torch.equal(param, _saved_as(saved["model"], name, param)), name
        moments = state.optimizer.state[param]
        for moment in ("exp_avg", "exp_avg_sq"):
            expected = saved["optim"]["state"][RENAMED.get(name, name)][moment].reshape(param.shape)
            assert torch.equal(moments[moment], expected), f"{name} {moment}"


def test_finetune_reads_the_former_names(saved):
    state = setup_training(MODEL, TRAINING)
    load_model_weights(CHECKPOINT, state.model, model_config=MODEL)
    for name, param in state.model.named_parameters():
        assert torch.equal(param, _saved_as(saved["model"], name, param)), name
