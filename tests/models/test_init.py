"""``init_weights``: the constructors' rules, values a function of (seed, name) only, meta-built equals eager."""

from __future__ import annotations

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.models.init import init_rules, init_weights


def config(**kw) -> TransformerConfig:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                vocab_size=96, qk_layernorm=True, add_bias_linear=True, num_moe_experts=4, moe_ffn_hidden_size=64,
                moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True, moe_layer_freq=[0, 1, 1, 1],
                moe_router_enable_expert_bias=True, init_method_std=0.05)
    return TransformerConfig(**{**base, **kw})


def check_rules(model: GPTModel) -> None:
    for name, param in model.named_parameters():
        rule = init_rules(model)[name]
        if rule in ("ones", "zeros"):
            assert torch.all(param == (1.0 if rule == "ones" else 0.0)), name
        elif param.numel() >= 4096:
            assert param.std().item() == pytest.approx(rule, rel=0.1), name
            assert abs(param.mean().item()) < 0.1 * rule, name


@pytest.mark.parametrize("grouped", [True, False])
def test_rules_are_the_constructors(grouped):
    """The constructors' own init follows ``init_rules`` (ones, zeros, the std of each matrix), and so does
    ``init_weights``: the two cannot drift apart."""
    torch.manual_seed(0)
    model = GPTModel(config(moe_grouped_gemm=grouped))
    check_rules(model)
    init_weights(model, seed=3)
    check_rules(model)
    assert model.decoder.layers[0].self_attention.linear_proj.weight.std().item() == pytest.approx(
        0.05 / (2 * 4) ** 0.5, rel=0.1)


def test_values_are_a_function_of_seed_and_name():
    torch.manual_seed(0)
    a = GPTModel(config())
    torch.manual_seed(1)
    b = GPTModel(config())
    init_weights(a, seed=5)
    init_weights(b, seed=5)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    init_weights(b, seed=6)
    drawn = [name for name, rule in init_rules(a).items() if rule not in ("ones", "zeros")]
    assert all(not torch.equal(a.get_parameter(n), b.get_parameter(n)) for n in drawn)
    firsts = {float(a.get_parameter(n).flatten()[0]) for n in drawn}
    assert len(firsts) == len(drawn), "every parameter draws from its own generator"


def test_meta_build_equals_eager_build():
    """What ``build_model`` does in one process: meta, to_empty, init_weights; buffers start at zero."""
    eager = GPTModel(config())
    init_weights(eager, seed=11)
    with torch.device("meta"):
        meta = GPTModel(config())
    meta.to_empty(device="cpu")
    init_weights(meta, seed=11)
    for (name, pe), pm in zip(eager.named_parameters(), meta.parameters(), strict=True):
        assert torch.equal(pe, pm), name
    assert all(int(b.count_nonzero()) == 0 for b in meta.buffers())
    with torch.device("meta"):
        unallocated = GPTModel(config())
    with pytest.raises(ValueError, match="meta device"):
        init_weights(unallocated, seed=1)
