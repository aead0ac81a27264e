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


def test_fused_clipping_equals_scaling_the_gradients(monkeypatch):
    """The fused AdamW path (grad_scale / found_inf) clips like scaling the gradients first."""
    import moe_core.training.step as step_module

    model_config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                                     moe_router_topk=2, moe_ffn_hidden_size=64, seq_length=32)
    cfg = TrainingConfig(micro_batch_size=2, bf16=False, clip_grad=1e-3, train_iters=3)  # clipping active
    tokens = torch.randint(0, 256, (2, 33))
    moments = []
    for fused in (True, False):
        monkeypatch.setattr(step_module, "_fused_plain", lambda optimizer, fused=fused: fused)
        state = setup_training(model_config, cfg)
        assert state.optimizer.defaults["fused"]
        loss, grad_norm, skipped = train_step(state, tokens[:, :-1], tokens[:, 1:])
        assert not skipped and grad_norm > cfg.clip_grad
        moments.append([state.optimizer.state[p]["exp_avg"] for p in state.model.parameters()])
    for fused_m, scaled_m in zip(*moments, strict=True):
        torch.testing.assert_close(fused_m, scaled_m, rtol=1e-5, atol=1e-12)


def test_non_finite_step_is_skipped_by_the_fused_optimizer():
    from tests.training.test_nonfinite_step import test_non_finite_gradient_skips_the_step

    test_non_finite_gradient_skips_the_step()  # setup_training picks CUDA here: the fused path


@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_cuda_graph_steps_follow_the_compiled_steps(num_micro_batches):
    """enable_cuda_graph: every compiled layer's forward and backward are recorded (none skipped, which Inductor
    counts) and then replayed (a later step records no graph); over steps of one or two micro-batches, the losses
    follow the compiled run without graphs (equal up to cuDNN attention's non-deterministic backward)."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    model_config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_moe_experts=8,
                                     moe_router_topk=2, moe_ffn_hidden_size=64, seq_length=64)
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    losses = {}
    for cuda_graph in (False, True):
        torch._dynamo.reset()
        counters.clear()
        state = setup_training(model_config, TrainingConfig(micro_batch_size=4 // num_micro_batches,
                                                            global_batch_size=4, bf16=True,
                                                            compile=True, enable_cuda_graph=cuda_graph,
                                                            train_iters=4))
        assert state.num_micro_batches == num_micro_batches
        losses[cuda_graph] = torch.stack([train_step(state, tokens[:, :-1], tokens[:, 1:])[0] for _ in range(4)])
    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and sum(len(nodes) for nodes in manager.roots.values()) > 0
    graph_ids = next(manager.graph_counter)  # the ids handed out so far (this call takes one more)
    train_step(state, tokens[:, :-1], tokens[:, 1:])
    assert next(manager.graph_counter) == graph_ids + 1, "a step after warm-up recorded a graph"
    assert counters["inductor"]["cudagraph_skips"] == 0  # the later step included
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-3, atol=0)
