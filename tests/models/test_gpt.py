"""GPTModel: shapes, loss convention, causality, GQA and RoPE against explicit references, tied embeddings,
init scales, layer patterns, parameter / FLOP counts, gradients and a training signal."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moe_core.config import TransformerConfig
from moe_core.mlp import MLP
from moe_core.models.attention import SelfAttention, qkv_row_blocks
from moe_core.models.gpt import GPTModel
from moe_core.models.rope import apply_rope, rope_cos_sin
from moe_core.moe.moe_layer import MoELayer
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training

VOCAB, HIDDEN, SEQ = 64, 32, 16


def tiny_config(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                vocab_size=VOCAB, seq_length=SEQ, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                qk_layernorm=True)
    return TransformerConfig(**{**base, **kw})


def test_shapes_and_loss_convention():
    torch.manual_seed(0)
    model = GPTModel(tiny_config())
    ids = torch.randint(0, VOCAB, (3, SEQ))
    labels = torch.randint(0, VOCAB, (3, SEQ))
    logits = model(ids)
    assert logits.shape == (3, SEQ, VOCAB) and logits.dtype == torch.float32
    loss = model(ids, labels)
    assert loss.shape == (3, SEQ) and loss.dtype == torch.float32
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(3, SEQ)
    torch.testing.assert_close(loss, reference)
    labels[1, 3] = -100
    masked = model(ids, labels)
    assert masked[1, 3].item() == 0.0
    torch.testing.assert_close(masked[0], reference[0])
    torch.testing.assert_close(model(ids.int()), logits)


@pytest.mark.parametrize("kw", [{}, dict(cross_entropy_chunk_size=5, qk_layernorm_span="projection"),
                                dict(num_moe_experts=8, moe_router_num_groups=4, moe_router_group_topk=2,
                                     moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)],
                         ids=["plain", "chunked-loss", "group-limited"])
def test_empty_micro_batch(kw):
    """A micro-batch of no sequences (a data-parallel rank left without data) runs forward and backward: empty
    logits and loss, and every parameter gets an exactly-zero gradient."""
    model = GPTModel(tiny_config(**kw))
    ids = torch.zeros(0, SEQ, dtype=torch.int64)
    assert model(ids).shape == (0, SEQ, VOCAB)
    loss = model(ids, ids)
    assert loss.shape == (0, SEQ)
    loss.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p.grad)), name


@pytest.mark.parametrize("ids,labels,error,match", [
    (torch.zeros(SEQ, dtype=torch.long), None, ValueError, "input_ids"),
    (torch.zeros(2, SEQ), None, TypeError, "input_ids"),
    (torch.zeros(2, SEQ, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), ValueError, "labels"),
    (torch.zeros(2, SEQ, dtype=torch.long), torch.zeros(2, SEQ), TypeError, "labels"),
])
def test_bad_inputs_raise_naming_the_argument(ids, labels, error, match):
    model = GPTModel(tiny_config(num_moe_experts=None))
    with pytest.raises(error, match=match):
        model(ids, labels)


@pytest.mark.parametrize("where, value, dtype, name, allowed", [
    ((1, 3), VOCAB, torch.int64, "input_ids", ""), ((0, 0), -1, torch.int32, "input_ids", ""),
    ((1, 3), VOCAB, torch.int64, "labels", " or -100"), ((0, 5), -2, torch.int64, "labels", " or -100"),
])
def test_token_ids_outside_the_vocabulary_raise(where, value, dtype, name, allowed):
    """Instead of the embedding's bare IndexError ("index out of range in self") or the loss's ("Target 64 is out
    of bounds"); label -100 is the ignore index and passes."""
    model = GPTModel(tiny_config(num_moe_experts=None))
    ids = torch.randint(0, VOCAB, (2, SEQ), dtype=dtype)
    labels = torch.full((2, SEQ), -100)
    model(ids, labels)
    (ids if name == "input_ids" else labels)[where] = value
    with pytest.raises(ValueError, match=rf"^{name}: expected token ids in \[0, {VOCAB}\) \(vocab_size {VOCAB}\)"
                                         rf"{allowed}, got {value}$"):
        model(ids, labels)


@pytest.mark.parametrize("num_moe_experts", [None, 4])
def test_causal(num_moe_experts):
    torch.manual_seed(0)
    model = GPTModel(tiny_config(num_moe_experts=num_moe_experts)).double()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % VOCAB
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=1e-12, atol=1e-12)
    assert (a[:, 10:] - b[:, 10:]).abs().amax() > 1e-3


def _reference_attention(attn: SelfAttention, x: torch.Tensor, rotary_base: float) -> torch.Tensor:
    """Explicit MHA: kv heads repeated per query group, masked softmax(q k^T / sqrt(D)) v."""
    batch, seq, _ = x.shape
    nq, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    blocks = qkv_row_blocks(nq, nkv, d)
    parts = attn.linear_qkv(x).split([stop - start for _, start, stop in blocks], dim=-1)
    q, k, v = (torch.cat([p for (s, _, _), p in zip(blocks, parts, strict=True) if s == name], dim=-1)
               for name in "qkv")
    q = q.view(batch, seq, nq, d).transpose(1, 2)
    k = k.view(batch, seq, nkv, d).transpose(1, 2)
    v = v.view(batch, seq, nkv, d).transpose(1, 2).repeat_interleave(nq // nkv, dim=1)
    if attn.q_layernorm is not None:
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + attn.q_layernorm.eps) * attn.q_layernorm.weight
        k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + attn.k_layernorm.eps) * attn.k_layernorm.weight
    k = k.repeat_interleave(nq // nkv, dim=1)
    cos, sin = rope_cos_sin(seq, d, rotary_base, x.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return attn.linear_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, nq * d))


@pytest.mark.parametrize("groups,qk_layernorm,bias", [(2, False, False), (1, True, True), (4, True, False)])
def test_attention_matches_repeated_kv_reference(groups, qk_layernorm, bias):
    torch.manual_seed(0)
    cfg = tiny_config(num_query_groups=groups, qk_layernorm=qk_layernorm, add_bias_linear=bias, kv_channels=6)
    attn = SelfAttention(cfg).double()
    if qk_layernorm:  # non-trivial norm weights, so a q/k mix-up shows
        torch.nn.init.uniform_(attn.q_layernorm.weight, 0.5, 1.5)
        torch.nn.init.uniform_(attn.k_layernorm.weight, 0.5, 1.5)
    x = torch.randn(2, 9, HIDDEN, dtype=torch.float64)
    out = attn(x, rope_cos_sin(9, 6, cfg.rotary_base, x.device))
    torch.testing.assert_close(out, _reference_attention(attn, x, cfg.rotary_base), rtol=1e-10, atol=1e-10)



def test_loss_is_its_own_tensor_and_may_be_masked_in_place():
    """The per-token loss is not a view (FSDP2 drops its backward hook on an in-place op on a returned view):
    masking it in place gives the gradient of the masked loss. The multi-rank FSDP2 case is in
    tests/parallel/test_gpt_ep.py."""
    torch.manual_seed(0)
    model = GPTModel(tiny_config()).double()
    ids, labels = torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ))
    loss = model(ids, labels)
    assert loss._base is None and loss.is_contiguous()
    loss[:, :3] = 0
    loss.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    mask = torch.ones(2, SEQ, dtype=torch.float64)
    mask[:, :3] = 0
    (model(ids, labels) * mask).sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-14)


def test_ep_size_has_one_source():
    """The config's expert_model_parallel_size and the process groups' EP size must agree on every path."""
    with pytest.raises(ValueError, match=r"EP size 1 \(1 when None\) differs .* expert_model_parallel_size \(2\)"):
        GPTModel(tiny_config(expert_model_parallel_size=2))
    with pytest.raises(ValueError, match=r"EP size 2 .* expert_model_parallel_size \(1\)"):
        GPTModel(tiny_config(), SimpleNamespace(ep_size=2))
    with pytest.raises(ValueError, match=r"EP size 2 .* expert_model_parallel_size \(1\)"):
        GPTModel(tiny_config(num_moe_experts=None), SimpleNamespace(ep_size=2))  # dense: no MoELayer checks it
    with pytest.raises(ValueError, match=r"EP size 1 .* expert_model_parallel_size \(2\)"):
        MoELayer(tiny_config(expert_model_parallel_size=2))
    with pytest.raises(ValueError, match=r"EP size 1 .* expert_model_parallel_size \(2\)"):
        setup_training(tiny_config(expert_model_parallel_size=2), TrainingConfig(micro_batch_size=2))


def test_rope_depends_on_relative_position_only():
    cos, sin = rope_cos_sin(32, 8, 10000.0, torch.device("cpu"))
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    q_rot = apply_rope(q.view(1, 1, 1, 8).expand(1, 1, 32, 8), cos, sin)[0, 0]  # [S, D]
    k_rot = apply_rope(k.view(1, 1, 1, 8).expand(1, 1, 32, 8), cos, sin)[0, 0]
    dots = q_rot @ k_rot.T  # [i, j]: q at position i with k at position j
    torch.testing.assert_close(dots[5, 2], dots[20, 17], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dots[3, 3], q @ k, rtol=1e-5, atol=1e-5)
    assert abs(dots[5, 2] - dots[5, 4]) > 1e-3
    torch.testing.assert_close(q_rot[0], q)  # position 0 is the identity
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm().expand(32), rtol=1e-5, atol=1e-5)  # a rotation


def test_tied_embeddings_share_storage():
    torch.manual_seed(0)
    tied = GPTModel(tiny_config(share_embeddings_and_output_weights=True, num_moe_experts=None))
    untied = GPTModel(tiny_config(num_moe_experts=None))
    assert tied.output_layer is None and not any("output_layer" in k for k in tied.state_dict())
    assert untied.num_parameters() - tied.num_parameters() == VOCAB * HIDDEN
    ids = torch.randint(0, VOCAB // 2, (2, SEQ))  # the upper half of the vocabulary never enters
    for model, output_rows_get_grad in ((tied, True), (untied, False)):
        model(ids, ids).sum().backward()
        unseen_rows_grad = model.embedding.weight.grad[VOCAB // 2:].abs().amax()
        assert (unseen_rows_grad > 0) == output_rows_get_grad
    with torch.no_grad():
        tied.embedding.weight[VOCAB - 1].zero_()
    assert torch.all(tied(ids)[..., VOCAB - 1] == 0)


def test_init_scales():
    torch.manual_seed(0)
    cfg = tiny_config(num_layers=8, hidden_size=256, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=512,
                      vocab_size=512, num_moe_experts=None, init_method_std=0.02)
    model = GPTModel(cfg)
    layer = model.decoder.layers[0]
    scaled = 0.02 / math.sqrt(2 * 8)
    for weight, std in ((model.embedding.weight, 0.02), (model.output_layer.weight, 0.02),
                        (layer.self_attention.linear_qkv.weight, 0.02), (layer.mlp.linear_fc1.weight, 0.02),
                        (layer.self_attention.linear_proj.weight, scaled), (layer.mlp.linear_fc2.weight, scaled)):
        assert weight.std().item() == pytest.approx(std, rel=0.03)
        assert abs(weight.mean().item()) < 0.1 * std
    assert torch.all(layer.input_layernorm.weight == 1)


def test_layer_patterns():
    model = GPTModel(tiny_config(num_layers=6, moe_layer_freq=2, first_k_dense_replace=1))
    assert [type(layer.mlp) for layer in model.decoder.layers] == [MLP, MLP, MoELayer, MLP, MoELayer, MLP]
    deepseek_like = GPTModel(tiny_config(num_layers=4, first_k_dense_replace=3))
    assert [type(layer.mlp) for layer in deepseek_like.decoder.layers] == [MLP, MLP, MLP, MoELayer]
    listed = GPTModel(tiny_config(num_layers=3, moe_layer_freq=[0, 1, 1]))
    assert [type(layer.mlp) for layer in listed.decoder.layers] == [MLP, MoELayer, MoELayer]
    assert listed.moe_layers() == [listed.decoder.layers[1].mlp, listed.decoder.layers[2].mlp]
    dense = GPTModel(tiny_config(num_moe_experts=None))
    assert all(type(layer.mlp) is MLP for layer in dense.decoder.layers) and not dense.moe_layers()
    assert dense.decoder.layers[0].mlp.linear_fc1.weight.shape == (2 * 48, HIDDEN)  # swiglu: gate and up


@pytest.mark.parametrize("grouped", [True, False])
def test_parameter_and_flop_counts(grouped):
    cfg = tiny_config(moe_grouped_gemm=grouped, moe_shared_expert_intermediate_size=8)
    model = GPTModel(cfg)
    per_expert = 3 * HIDDEN * 24  # fc1 (gate and up) and fc2 of one swiglu expert
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert model.num_parameters() - model.num_parameters(active=True) == 2 * (4 - 2) * per_expert
    attention = HIDDEN * (4 + 2 * 2) * 8 + 4 * 8 * HIDDEN + 2 * 8  # qkv, proj, q/k norms (D = 8)
    layer = attention + 2 * HIDDEN + HIDDEN * 4 + 2 * per_expert + 3 * HIDDEN * 8  # norms, router, topk, shared
    expected_active = 2 * VOCAB * HIDDEN + 2 * layer + HIDDEN
    assert model.num_parameters(active=True) == expected_active
    expected_flops = 6 * (expected_active - VOCAB * HIDDEN) + 12 * 2 * 4 * 8 * SEQ
    assert model.flops_per_token() == expected_flops


def test_bf16_autocast_keeps_float32_logits_and_loss():
    torch.manual_seed(0)
    model = GPTModel(tiny_config(num_moe_experts=None))
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(ids), model(ids, ids)
    assert logits.dtype == loss.dtype == torch.float32
    torch.testing.assert_close(loss, model(ids, ids), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("grouped,bias", [(True, False), (False, True)])
def test_every_parameter_gets_a_gradient_even_with_idle_experts(grouped, bias):
    torch.manual_seed(0)
    cfg = tiny_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_grouped_gemm=grouped, add_bias_linear=bias, moe_shared_expert_intermediate_size=8)
    model = GPTModel(cfg)
    for layer in model.moe_layers():
        layer.router.expert_bias[2:] = -1e4  # selection only: experts 2 and 3 are never chosen
    ids = torch.randint(0, VOCAB, (2, SEQ))
    model(ids, ids).mean().backward()
    idle = set()
    for layer in model.moe_layers():
        loads = layer.router.recorder.tokens_per_expert
        assert loads[2:].sum() == 0 and loads[:2].sum() > 0
        if grouped:
            idle |= {id(p) for p in layer.experts.parameters()}
            for p in layer.experts.parameters():
                assert torch.all(p.grad[2:] == 0) and p.grad[:2].abs().amax() > 0
        else:
            for e, expert in enumerate(layer.experts.local_experts):
                if e >= 2:
                    idle |= {id(p) for p in expert.parameters()}
                    assert all(torch.all(p.grad == 0) for p in expert.parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        if id(p) not in idle:
            assert p.grad.abs().amax() > 0, name


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = GPTModel(tiny_config(moe_aux_loss_coeff=0.01))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, VOCAB, (4, SEQ + 1))
    losses = []
    for _ in range(15):
        loss = model(ids[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.05)  # small init: near-uniform predictions
    assert losses[-1] < 0.7 * losses[0]
