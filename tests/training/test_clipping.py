"""train_step clips only when the global gradient norm exceeds ``max_norm``: gradients within it reach AdamW
bitwise as backward left them, larger ones are scaled by ``max_norm / norm`` (in place, or inside a fused
AdamW's kernel through ``grad_scale``)."""

from __future__ import annotations

import functools

import pytest
import torch

import moe_core.training.step as step_module
from moe_core.config import TransformerConfig
from moe_core.parallel.grad_clip import get_grad_norm
from moe_core.training.config import TrainingConfig

MODEL = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                          moe_ffn_hidden_size=16, ffn_hidden_size=32, seq_length=8)


def _step_and_watch(clip_grad: float, monkeypatch) -> dict:
    """One step of a fresh model; the gradients as backward left them (``backward``) and as AdamW's step
    received them (``adamw``, with the optimizer's ``grad_scale``), and the norm."""
    state = step_module.setup_training(MODEL, TrainingConfig(micro_batch_size=2, train_iters=3,
                                                             clip_grad=clip_grad))
    seen = {}

    def norm_after_backward(dense, experts, pg):
        seen["backward"] = [p.grad.clone() for p in state.model.parameters()]
        return get_grad_norm(dense, experts, pg)

    def record(optimizer, args, kwargs):
        seen["adamw"] = [p.grad.clone() for p in state.model.parameters()]
        seen["grad_scale"] = getattr(optimizer, "grad_scale", None)

    monkeypatch.setattr(step_module, "get_grad_norm", norm_after_backward)
    state.optimizer.register_step_pre_hook(record)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    _, grad_norm, skipped = step_module.train_step(state, tokens[:, :-1], tokens[:, 1:])
    assert not skipped and grad_norm > 1e-3
    return dict(seen, grad_norm=float(grad_norm))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_only_gradients_above_max_norm_are_clipped(fused, monkeypatch):
    monkeypatch.setattr(step_module, "build_optimizer", functools.partial(step_module.build_optimizer, fused=fused))
    within = _step_and_watch(1e6, monkeypatch)
    assert within["grad_scale"] is None
    assert all(torch.equal(a, b) for a, b in zip(within["adamw"], within["backward"], strict=True))

    max_norm = 1e-3
    above = _step_and_watch(max_norm, monkeypatch)
    coef = max_norm / (above["grad_norm"] + 1e-6)
    if fused:  # the kernel divides by grad_scale; the gradients arrive as backward left them
        assert float(above["grad_scale"]) == pytest.approx(1 / coef, rel=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(above["adamw"], above["backward"], strict=True))
    else:
        assert above["grad_scale"] is None
        for a, b in zip(above["adamw"], above["backward"], strict=True):
            torch.testing.assert_close(a, b * coef)
