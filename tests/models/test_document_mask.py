"""Document masking: a row packing several documents gives each the logits (and gradients) it has alone; the
FlexAttention block mask and SDPA's boolean mask agree; RoPE positions restart per document."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from moe_core.config import TransformerConfig
from moe_core.models import document_mask
from moe_core.models.document_mask import document_causal_mask, masked_attention
from moe_core.models.gpt import GPTModel
from moe_core.models.rope import rope_at, rope_cos_sin

VOCAB, SEQ = 64, 24
LENGTHS = [[5, 11, 1, 7], [24], [3, 3, 18]]  # documents of each row, a one-token document among them


def tiny_config(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                vocab_size=VOCAB, seq_length=SEQ, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                qk_layernorm=True, moe_router_dtype="fp64")  # float64 throughout: sums over other tokens round alike
    return TransformerConfig(**{**base, **kw})


def packed_rows(lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids, document_ids)`` ``[B, S]`` of rows made of documents of ``lengths``."""
    positions = [torch.cat([torch.arange(n) for n in row]) for row in lengths]
    documents = [torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths]
    return torch.stack(positions), torch.stack(documents)


def _flex_on_cpu(monkeypatch):
    monkeypatch.setattr(document_mask, "use_flex", lambda device: True)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


@pytest.mark.parametrize("flex", [False, True], ids=["sdpa", "flex"])
@pytest.mark.parametrize("kw", [{}, dict(num_query_groups=4, qk_layernorm=False, moe_layer_freq=[0, 1]),
                                dict(recompute_granularity="selective", recompute_modules=["core_attn"])],
                         ids=["gqa-moe", "mha-dense-first", "core-attn-recompute"])
def test_packed_logits_equal_each_document_alone(monkeypatch, flex, kw):
    if flex:
        _flex_on_cpu(monkeypatch)  # FlexAttention runs eagerly on the CPU, forward only
    torch.manual_seed(0)
    model = GPTModel(tiny_config(**kw)).double().eval()
    ids = torch.randint(0, VOCAB, (len(LENGTHS), SEQ))
    position_ids, document_ids = packed_rows(LENGTHS)
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, document_ids=document_ids)
        for b, row in enumerate(LENGTHS):
            start = 0
            for n in row:
                alone = model(ids[b:b + 1, start:start + n])[0]
                torch.testing.assert_close(packed[b, start:start + n], alone, rtol=1e-12, atol=1e-12)
                start += n
        # Without the mask the first document's successors see it: the test can tell the difference.
        unmasked = model(ids, position_ids=position_ids)
        assert not torch.allclose(unmasked[0, 5:16], packed[0, 5:16], atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True])
def test_packed_gradients_equal_the_documents_summed(recompute):
    """One backward over the packed loss gives the gradients of the documents' losses run one at a time."""
    kw = dict(recompute_granularity="selective", recompute_modules=["core_attn"]) if recompute else {}
    torch.manual_seed(1)
    model = GPTModel(tiny_config(**kw)).double()
    ids = torch.randint(0, VOCAB, (len(LENGTHS), SEQ))
    labels = torch.randint(0, VOCAB, (len(LENGTHS), SEQ))
    position_ids, document_ids = packed_rows(LENGTHS)
    model(ids, labels, position_ids, document_ids).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            model(ids[b:b + 1, start:start + n], labels[b:b + 1, start:start + n]).sum().backward()
            start += n
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_flex_block_mask_and_sdpa_boolean_mask_agree(groups):
    _, document_ids = packed_rows(LENGTHS)
    gen = torch.Generator().manual_seed(groups)
    q = torch.randn(3, 4, SEQ, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(3, groups, SEQ, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    dense = document_causal_mask(document_ids, flex=False)
    assert dense.shape == (3, 1, SEQ, SEQ) and dense.dtype == torch.bool
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_out = masked_attention(q, k, v, document_causal_mask(document_ids, flex=True), enable_gqa=groups < 4)
    sdpa_out = masked_attention(q, k, v, dense, enable_gqa=groups < 4)
    torch.testing.assert_close(flex_out, sdpa_out, rtol=1e-12, atol=1e-12)
    # The boolean mask itself: causal within each document, nothing across.
    i, j = torch.meshgrid(torch.arange(SEQ), torch.arange(SEQ), indexing="ij")
    for b in range(3):
        expected = (j <= i) & (document_ids[b, :, None] == document_ids[b, None, :])
        assert torch.equal(dense[b, 0], expected)


@pytest.mark.parametrize("seq", [256, 200])
def test_block_mask_skips_the_blocks_create_block_mask_skips(seq):
    """The block structure from id ranges is ``create_block_mask``'s (which evaluates every point); a sequence that
    is not a multiple of the block size keeps its last blocks partial. Unsorted ids stay exact: the mask_mod
    decides inside the blocks their ranges admit."""
    gen = torch.Generator().manual_seed(seq)
    ends = torch.zeros(2, seq, dtype=torch.int64)
    ends[0, [40, 130, 131, 190]] = 1
    ends[1, torch.randint(1, seq, (6,), generator=gen)] = 1
    sorted_ids = ends.cumsum(1)
    ours = document_causal_mask(sorted_ids, flex=True)
    reference = create_block_mask(lambda b, h, q, k: (k <= q) & (sorted_ids[b, q] == sorted_ids[b, k]), 2, None,
                                  seq, seq, device="cpu")
    if seq % 128 == 0:
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            assert torch.equal(getattr(ours, name), getattr(reference, name)), name
        assert torch.equal(ours.to_dense(), reference.to_dense())
    shuffled = torch.randint(0, 3, (2, seq), generator=gen)
    q, k, v = (torch.randn(2, 2, seq, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    for ids in (sorted_ids, shuffled):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex_out = masked_attention(q, k, v, document_causal_mask(ids, flex=True))
        torch.testing.assert_close(flex_out, masked_attention(q, k, v, document_causal_mask(ids, flex=False)),
                                   rtol=1e-12, atol=1e-12)


def test_one_document_is_plain_causal_attention():
    torch.manual_seed(2)
    model = GPTModel(tiny_config()).double().eval()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    zeros = torch.zeros(2, SEQ, dtype=torch.int64)
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=positions, document_ids=zeros), model(ids),
                                   rtol=1e-12, atol=1e-12)


def test_position_and_document_ids_are_checked():
    model = GPTModel(tiny_config())
    ids = torch.zeros(2, SEQ, dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"position_ids: expected positions in \[0, {SEQ}\), got {SEQ}$"):
        model(ids, position_ids=torch.full((2, SEQ), SEQ))
    with pytest.raises(ValueError, match=r"document_ids: expected shape \(2, 24\), got \(2, 23\)"):
        model(ids, document_ids=torch.zeros(2, SEQ - 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="position_ids: expected a tensor of torch.int64, got torch.float32"):
        model(ids, position_ids=torch.zeros(2, SEQ))
    with pytest.raises(ValueError, match=r"document_ids: expected \[B, S\] integer ids, got torch.float32"):
        document_causal_mask(torch.zeros(2, SEQ))


def test_position_ids_restart_rope():
    """``rope_at`` takes each token's angles from the position table; positions change attention only across
    documents (RoPE is relative, so a document alone sees the same scores at any offset)."""
    cos, sin = rope_cos_sin(SEQ, 8, 1e4, torch.device("cpu"))
    position_ids, document_ids = packed_rows(LENGTHS)
    cos_at, sin_at = rope_at(cos, sin, position_ids)
    assert cos_at.shape == (3, 1, SEQ, 8)
    assert torch.equal(cos_at[0, 0, 5:16], cos[:11]) and torch.equal(sin_at[2, 0, 6:], sin[:18])
    torch.manual_seed(3)
    model = GPTModel(tiny_config(num_layers=1)).double().eval()
    ids = torch.randint(0, VOCAB, (3, SEQ))
    with torch.no_grad():
        restarted = model(ids, position_ids=position_ids)
        counted = model(ids)
    torch.testing.assert_close(restarted[:, :3], counted[:, :3], rtol=1e-12, atol=1e-12)  # the first documents
    assert not torch.allclose(restarted[0, 5:16], counted[0, 5:16], atol=1e-6)
