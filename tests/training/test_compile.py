"""``compile``: each transformer layer compiled whole (``fullgraph=True``: a graph break fails the step) trains as
the eager model does, on CPU as on a GPU."""

from __future__ import annotations

import torch

from moe_core.config import TransformerConfig
from moe_core.training.batch import DocumentMasking
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training, train_step

MODEL = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                          moe_ffn_hidden_size=16, ffn_hidden_size=32, seq_length=8)


def _losses(compile: bool) -> tuple[list[float], list]:
    torch._dynamo.reset()
    state = setup_training(MODEL, TrainingConfig(micro_batch_size=2, train_iters=3, compile=compile))
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))  # one batch, learnt
    losses = [float(train_step(state, tokens[:, :-1], tokens[:, 1:])[0]) for _ in range(3)]
    return losses, [layer._compiled_call_impl for layer in state.model.decoder.layers]


def test_compiled_layers_train_as_the_eager_model():
    compiled, impls = _losses(compile=True)
    eager, eager_impls = _losses(compile=False)
    assert all(impl is not None for impl in impls) and all(impl is None for impl in eager_impls)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)
    assert compiled[-1] < compiled[0]


def _masked_losses(compile: bool) -> list[float]:
    torch._dynamo.reset()
    state = setup_training(MODEL, TrainingConfig(micro_batch_size=2, train_iters=3, compile=compile))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 9), generator=gen)
    masking = DocumentMasking(eod=7, reset_position_ids=True, reset_attention_mask=True)
    losses = []
    for step in range(3):  # other documents every step: the compiled layers must not recompile for them
        inputs = tokens[:, :-1].clone()
        inputs[:, torch.randint(1, 7, (2,), generator=gen)] = 7
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            losses.append(float(train_step(state, *masking(inputs, tokens[:, 1:]))[0]))
    return losses


def test_compiled_layers_with_document_masks_train_as_the_eager_model():
    torch.testing.assert_close(torch.tensor(_masked_losses(True)), torch.tensor(_masked_losses(False)),
                               rtol=1e-5, atol=0)
