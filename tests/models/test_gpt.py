"""GPTModel: shapes, causality, loss convention, GQA and RoPE properties, layer patterns, training signal."""

import pytest
import torch
import torch.nn.functional as F

from moe_core.config import TransformerConfig
from moe_core.mlp import MLP
from moe_core.models.attention import SelfAttention
from moe_core.models.gpt import GPTModel
from moe_core.models.rope import apply_rope, rope_cos_sin
from moe_core.moe.moe_layer import MoELayer


def tiny_config(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                vocab_size=64, seq_length=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                qk_layernorm=True)
    return TransformerConfig(**{**base, **kw})


def test_shapes_and_loss_convention():
    torch.manual_seed(0)
    model = GPTModel(tiny_config())
    ids = torch.randint(0, 64, (3, 16))
    labels = torch.randint(0, 64, (3, 16))
    logits = model(ids)
    assert logits.shape == (3, 16, 64) and logits.dtype == torch.float32
    loss = model(ids, labels)
    assert loss.shape == (3, 16) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(3, 16))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels[:, :4])
    with pytest.raises(ValueError, match="input_ids"):
        model(ids.flatten())


def test_causal():
    torch.manual_seed(0)
    model = GPTModel(tiny_config(num_moe_experts=None)).double().eval()
    ids = torch.randint(0, 64, (1, 16))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 64
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_matches_repeated_kv_reference():
    torch.manual_seed(0)
    cfg = tiny_config(qk_layernorm=False)
    attn = SelfAttention(cfg).double()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    out = attn(x)
    q, k, v = attn.linear_qkv(x).split([32, 16, 16], dim=-1)
    q = q.view(2, 16, 4, 8).transpose(1, 2)
    k = k.view(2, 16, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    v = v.view(2, 16, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    cos, sin = rope_cos_sin(16, 8, cfg.rotary_base, x.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 32)
    torch.testing.assert_close(out, attn.linear_proj(ref))


def test_rope_depends_on_relative_position_only():
    cos, sin = rope_cos_sin(32, 8, 10000.0, torch.device("cpu"))
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)

    def dot(i, j):
        qi = apply_rope(q.view(1, 1, 1, 8).expand(1, 1, 32, 8), cos, sin)[0, 0, i]
        kj = apply_rope(k.view(1, 1, 1, 8).expand(1, 1, 32, 8), cos, sin)[0, 0, j]
        return (qi.double() * kj.double()).sum()

    torch.testing.assert_close(dot(5, 2), dot(20, 17), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(dot(5, 2), dot(5, 4))


def test_tied_embeddings_share_storage():
    model = GPTModel(tiny_config(share_embeddings_and_output_weights=True))
    assert model.output_layer is None
    untied = GPTModel(tiny_config())
    vocab_hidden = 64 * 32
    assert untied.num_parameters() - model.num_parameters() == vocab_hidden


def test_layer_patterns():
    model = GPTModel(tiny_config(num_layers=6, moe_layer_freq=2, first_k_dense_replace=1))
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    assert kinds == [MLP, MLP, MoELayer, MLP, MoELayer, MLP]
    listed = GPTModel(tiny_config(num_layers=3, moe_layer_freq=[0, 1, 1]))
    assert [type(layer.mlp) for layer in listed.decoder.layers] == [MLP, MoELayer, MoELayer]
    dense = GPTModel(tiny_config(num_moe_experts=None))
    assert not dense.moe_layers()


def test_active_parameters_count_topk_of_experts():
    model = GPTModel(tiny_config())
    routed = sum(sum(p.numel() for p in m.experts.parameters()) for m in model.moe_layers())
    assert model.num_parameters() - model.num_parameters(active=True) == routed // 2
    assert model.flops_per_token() > 6 * (model.num_parameters(active=True) - 64 * 32)


def test_every_parameter_gets_a_gradient_even_with_idle_experts():
    torch.manual_seed(0)
    model = GPTModel(tiny_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True))
    for layer in model.moe_layers():
        layer.router.expert_bias[2:] = -1e4  # selection only: experts 2 and 3 never chosen, idle
    ids = torch.randint(0, 64, (2, 16))
    model(ids, ids).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    for layer in model.moe_layers():
        assert layer.router.tokens_per_expert[2:].sum() == 0
        assert torch.equal(layer.experts.fc1.weight.grad[2:], torch.zeros_like(layer.experts.fc1.weight.grad[2:]))


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = GPTModel(tiny_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(15):
        loss = model(ids[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
