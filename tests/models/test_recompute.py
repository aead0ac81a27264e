"""Activation recompute (``moe_core.recompute``): every granularity, method and module gives the gradients of the
run without recompute bit for bit, the router's load counters count each forward once, the config follows
Megatron's rules, and on a GPU the activations kept after the forward shrink."""

import pytest
import torch

from moe_core.config import RECOMPUTE_MODULES, TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.recompute import full_recompute_groups, is_recomputing

RECOMPUTE = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "selective-default": dict(recompute_granularity="selective"),
    "selective-all-but-moe": dict(recompute_granularity="selective",
                                  recompute_modules=[m for m in RECOMPUTE_MODULES if m != "moe"]),
    "selective-moe": dict(recompute_granularity="selective", recompute_modules=["moe", "layernorm"]),
}


def config(**kw) -> TransformerConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64, seq_length=16,
                num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1, 1, 1],
                moe_shared_expert_intermediate_size=16, moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
                moe_aux_loss_coeff=[0.01, 0.01], moe_z_loss_coeff=1e-3, moe_input_jitter_eps=0.01)
    return TransformerConfig(**{**base, **kw})


def train_grads(cfg: TransformerConfig, device: str = "cpu", forwards: int = 2, autocast: bool = False):
    """Gradients and router loads after ``forwards`` forward + backward passes on different batches (one optimizer
    step's micro-batches: the global aux loss sums their loads; the jitter draws random numbers)."""
    torch.manual_seed(0)
    model = GPTModel(cfg).to(device)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(5)
    for _ in range(forwards):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=generator).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, ids).sum()
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    loads = [layer.router.local_tokens_per_expert for layer in model.moe_layers()]
    return grads, loads


@pytest.mark.parametrize("kw", RECOMPUTE.values(), ids=RECOMPUTE.keys())
def test_gradients_bitwise_equal_without_recompute(kw):
    want_grads, want_loads = train_grads(config())
    grads, loads = train_grads(config(**kw))
    for name, want in want_grads.items():
        assert torch.equal(grads[name], want), name
    for got, want in zip(loads, want_loads, strict=True):
        assert torch.equal(got, want)  # counted once per forward, not again when recomputed
    assert not is_recomputing()


def test_negative_control_router_counting_a_recomputed_forward(monkeypatch):
    """Without the router's guard a recomputed MoE layer counts its loads twice (the expert-bias update and the
    logged loads would see them): the comparison above catches it."""
    import moe_core.moe.router as router

    monkeypatch.setattr(router, "is_recomputing", lambda: False)
    _, want_loads = train_grads(config())
    _, loads = train_grads(config(**RECOMPUTE["selective-moe"]))
    for got, want in zip(loads, want_loads, strict=True):
        torch.testing.assert_close(got, 2 * want)


def test_moe_act_with_probs_on_output():
    want, _ = train_grads(config(moe_apply_probs_on_output=True))
    got, _ = train_grads(config(moe_apply_probs_on_output=True, recompute_granularity="selective",
                                recompute_modules=["moe_act"]))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_full_recompute_groups():
    assert full_recompute_groups(5, "uniform", 2) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert full_recompute_groups(5, "block", 2) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert full_recompute_groups(2, "block", 4) == [(0, 1, True), (1, 2, True)]


@pytest.mark.parametrize("kw,match", [
    (dict(recompute_granularity="partial"), "recompute_granularity"),
    (dict(recompute_granularity="full"), "recompute_method, recompute_num_layers"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "recompute_method, recompute_num_layers"),
    (dict(recompute_granularity="full", recompute_method="even", recompute_num_layers=1), "recompute_method"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0), "recompute_num_layers"),
    (dict(recompute_method="block", recompute_num_layers=1), "only with recompute_granularity 'full'"),
    (dict(recompute_modules=["moe"]), "recompute_modules: only with recompute_granularity 'selective'"),
    (dict(recompute_granularity="selective", recompute_modules=["attention"]), "recompute_modules"),
    (dict(recompute_granularity="selective", recompute_modules="moe"), "recompute_modules"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=False),
     "'moe_act' recomputes GroupedMLP's activation"),
])
def test_config_follows_megatrons_rules(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        config(**kw)
    assert config(recompute_granularity="selective").recompute_modules == ["core_attn"]


def _kept_after_forward(cfg: TransformerConfig) -> int:
    """CUDA bytes allocated after a bf16-autocast forward, beyond those before it: what backward will read."""
    torch.manual_seed(0)
    model = GPTModel(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_length), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, ids).sum()
    kept = torch.cuda.memory_allocated() - before
    loss.backward()
    return kept


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [RECOMPUTE["full-uniform"], dict(recompute_granularity="selective",
                                                               recompute_modules=["layernorm"]),
                                dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
                                dict(recompute_granularity="selective", recompute_modules=["moe"])],
                         ids=["full", "layernorm", "moe_act", "moe"])
def test_recompute_keeps_fewer_activations_on_cuda(kw):
    shape = dict(hidden_size=256, num_attention_heads=4, num_query_groups=4, seq_length=256, moe_ffn_hidden_size=256,
                 moe_input_jitter_eps=None)
    baseline, recomputed = _kept_after_forward(config(**shape)), _kept_after_forward(config(**shape, **kw))
    assert recomputed < baseline, (recomputed, baseline)


@pytest.mark.gpu
def test_bitwise_on_cuda_under_autocast():
    want, _ = train_grads(config(), "cuda", autocast=True)
    got, _ = train_grads(config(**RECOMPUTE["selective-all-but-moe"]), "cuda", autocast=True)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("name", ["full-uniform", "selective-all-but-moe", "selective-moe"])
def test_compiled_layers_recompute(name):
    """Each layer compiled (as the trainer does) inside and around the checkpoints: the eager run's gradients."""
    want, _ = train_grads(config(moe_input_jitter_eps=None))
    torch._dynamo.reset()  # compiled afresh, not against earlier tests' cached frames
    torch.manual_seed(0)
    model = GPTModel(config(moe_input_jitter_eps=None, **RECOMPUTE[name]))
    for layer in model.decoder.layers:
        layer.compile(backend="aot_eager")
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (2, model.config.seq_length), generator=generator)
        model(ids, ids).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7)
