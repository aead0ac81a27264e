"""A training step on CUDA under bf16 autocast reaches the 16-bit grouped-GEMM kernels and keeps float32
parameters and gradients."""

import pytest
import torch

from moe_core import TransformerConfig
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training, train_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_bf16_training_step_never_takes_the_portable_kernel(compile, monkeypatch, capfd):
    monkeypatch.setenv("MOE_CORE_GEMM_DEBUG", "1")
    model_config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_moe_experts=8,
                                     moe_router_topk=2, moe_ffn_hidden_size=64, seq_length=64)
    state = setup_training(model_config, TrainingConfig(micro_batch_size=4, bf16=True, compile=compile,
                                                        train_iters=3))
    tokens = torch.randint(0, 256, (4, 65))
    with state.autocast():
        loss = state.model(tokens[:, :-1].cuda(), tokens[:, 1:].cuda()).mean()
    loss.backward()
    params = list(state.model.parameters())
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    state.optimizer.zero_grad()
    for _ in range(2):
        step_loss, grad_norm, skipped = train_step(state, tokens[:, :-1], tokens[:, 1:])
    torch.cuda.synchronize()
    assert torch.isfinite(step_loss) and torch.isfinite(grad_norm) and not skipped
    err = capfd.readouterr().err
    assert "portable kernel" not in err
    if torch.cuda.get_device_capability() == (9, 0):
        assert "tile" in err  # the Hopper kernels announced themselves
