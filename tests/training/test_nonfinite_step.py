"""train_step skips a step with a non-finite gradient norm: weights, AdamW's moments, the LR schedule and the
expert biases stay as they were, the gradients are dropped, and the next finite step trains normally."""

from __future__ import annotations

import copy

import torch

from moe_core.config import TransformerConfig
from moe_core.training.config import TrainingConfig
from moe_core.training.data import sample_batch
from moe_core.training.step import setup_training, train_step

MODEL = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                          moe_ffn_hidden_size=16, ffn_hidden_size=32, seq_length=8,
                          moe_router_enable_expert_bias=True)


def _snapshot(state) -> dict:
    return {"model": copy.deepcopy(state.model.state_dict()), "optim": copy.deepcopy(state.optimizer.state_dict()),
            "lr": state.scheduler.get_last_lr(), "epoch": state.scheduler.last_epoch,
            "bias": state.model.decoder.layers[0].mlp.router.expert_bias.clone()}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_non_finite_gradient_skips_the_step():
    state = setup_training(MODEL, TrainingConfig(micro_batch_size=2, train_iters=10, lr_warmup_iters=0))
    tokens = torch.randint(0, 256, (500,)).numpy()
    inputs, labels = sample_batch(tokens, 2, 8, 0, 0)
    train_step(state, inputs, labels)  # a finite step: AdamW has moments now
    before = _snapshot(state)
    weight = state.model.decoder.layers[0].self_attention.linear_proj.weight
    hook = weight.register_hook(lambda grad: grad * float("nan"))
    loss, grad_norm, skipped = train_step(state, *sample_batch(tokens, 2, 8, 0, 1))
    hook.remove()
    assert skipped and torch.isfinite(loss) and torch.isnan(grad_norm)
    assert _equal(_snapshot(state), before)
    assert all(p.grad is None for p in state.model.parameters())
    assert not state.model.decoder.layers[0].mlp.router.local_tokens_per_expert.any()

    loss, grad_norm, skipped = train_step(state, *sample_batch(tokens, 2, 8, 0, 2))
    assert not skipped and torch.isfinite(grad_norm)
    after = _snapshot(state)
    assert after["epoch"] == before["epoch"] + 1
    assert not torch.equal(after["model"]["output_layer.weight"], before["model"]["output_layer.weight"])
    assert not torch.equal(after["bias"], before["bias"])
