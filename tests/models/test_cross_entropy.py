"""Chunked cross-entropy: the same per-token loss and gradients as the whole-batch computation, and no tensor
of ``[T, V]`` in forward or backward (every op's output recorded by a dispatch mode)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_core.config import TransformerConfig
from moe_core.models.cross_entropy import chunked_cross_entropy
from moe_core.models.gpt import GPTModel

TOKENS, HIDDEN, VOCAB, CHUNK = 40, 16, 64, 12


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels[3] = labels[17] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, CHUNK, TOKENS, None])
def test_chunks_equal_the_whole(chunk):
    hidden, weight, labels = _inputs()
    upstream = torch.rand(TOKENS, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole = chunked_cross_entropy(hidden, weight, labels)
    grads = torch.autograd.grad(whole, (hidden, weight), upstream)
    chunked = chunked_cross_entropy(hidden, weight, labels, chunk)
    chunked_grads = torch.autograd.grad(chunked, (hidden, weight), upstream)
    assert chunked.dtype == torch.float32 and chunked.shape == (TOKENS,)
    assert chunked[3] == 0 and chunked[17] == 0
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
    for got, want in zip(chunked_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_no_tensor_holds_every_tokens_logits():
    hidden, weight, labels = _inputs(torch.float32)
    with _Shapes() as recorded:
        loss = chunked_cross_entropy(hidden, weight, labels, CHUNK)
        loss.sum().backward()
    weights = ((VOCAB, HIDDEN), (HIDDEN, VOCAB))
    logits_like = [s for s in recorded.shapes if len(s) == 2 and VOCAB in s and s not in weights]
    assert logits_like and max(min(s) for s in logits_like) == CHUNK, sorted(set(logits_like))
    with _Shapes() as unchunked:
        chunked_cross_entropy(hidden, weight, labels).sum().backward()
    assert (TOKENS, VOCAB) in unchunked.shapes  # the control: without chunks the [T, V] logits exist


def test_gpt_model_with_chunks_equals_without():
    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, vocab_size=VOCAB, seq_length=10)
    torch.manual_seed(0)
    whole = GPTModel(TransformerConfig(**base)).double()
    chunked = GPTModel(TransformerConfig(**base, cross_entropy_chunk_size=7)).double()
    chunked.load_state_dict(whole.state_dict())
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    for model in (whole, chunked):
        model(ids, ids.roll(1, dims=1)).sum().backward()
    torch.testing.assert_close(chunked(ids, ids), whole(ids, ids), rtol=0, atol=0)
    for (name, a), b in zip(chunked.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=name)
