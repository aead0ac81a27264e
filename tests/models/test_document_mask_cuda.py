"""Document masking on CUDA: compiled FlexAttention block masks give SDPA's boolean-mask results, forward and
backward, eagerly and inside compiled layers (also replayed as CUDA graphs) without recompiling for new documents."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from moe_core.config import TransformerConfig
from moe_core.models import document_mask
from moe_core.models.document_mask import document_causal_mask
from moe_core.models.gpt import GPTModel
from moe_core.training.batch import DocumentMasking
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training, train_step
from tests.models.test_document_mask import packed_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ = 256
LENGTHS = [[100, 3, 153], [256], [1, 128, 127]]
CONFIG = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                           num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, seq_length=SEQ,
                           qk_layernorm=True)


def _logits_and_grads(monkeypatch, flex: bool):
    monkeypatch.setattr(document_mask, "use_flex", lambda device: flex)
    torch.manual_seed(0)
    model = GPTModel(CONFIG).cuda()
    ids = torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(1)).cuda()
    position_ids, document_ids = (t.cuda() for t in packed_rows(LENGTHS))
    assert isinstance(document_causal_mask(document_ids), BlockMask) == flex
    logits = model(ids, position_ids=position_ids, document_ids=document_ids)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}, model, ids


def test_flex_block_mask_matches_sdpa_boolean_mask(monkeypatch):
    flex_logits, flex_grads, model, ids = _logits_and_grads(monkeypatch, True)
    sdpa_logits, sdpa_grads, _, _ = _logits_and_grads(monkeypatch, False)
    torch.testing.assert_close(flex_logits, sdpa_logits, rtol=1e-4, atol=1e-4)
    for name, grad in flex_grads.items():
        torch.testing.assert_close(grad, sdpa_grads[name], rtol=1e-3, atol=1e-5, msg=name)
    with torch.no_grad():  # each document as it is alone
        torch.testing.assert_close(flex_logits[0, 100:103], model(ids[:1, 100:103])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["compiled", "cuda-graphs"])
def test_compiled_layers_take_block_masks_without_recompiling(cuda_graph):
    torch._dynamo.reset()
    state = setup_training(CONFIG, TrainingConfig(micro_batch_size=2, global_batch_size=4, compile=True, bf16=True,
                                                  eod_mask_loss=True, enable_cuda_graph=cuda_graph))
    masking = DocumentMasking(eod=7, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        tokens = torch.randint(8, 256, (4, SEQ + 1), generator=gen)
        tokens[:, torch.randint(0, SEQ, (3,), generator=gen)] = 7  # other documents every step
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss, grad_norm, skipped = train_step(state, *masking(tokens[:, :-1], tokens[:, 1:]))
        assert torch.isfinite(loss) and not skipped
