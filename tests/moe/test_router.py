"""TopKRouter: each knob against a hand-computed float64 reference, losses and their gradients, expert bias,
capacity, errors."""

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.moe.capacity import apply_token_dropping, get_capacity
from moe_core.moe.router import TopKRouter

H, E, K = 8, 8, 2


def make_config(**kw) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K,
                moe_router_dtype="fp64", moe_aux_loss_coeff=0.0, init_method_std=0.5)
    return TransformerConfig(**{**base, **kw})


def make_router(**kw) -> TopKRouter:
    torch.manual_seed(0)
    return TopKRouter(make_config(**kw)).double()


def losses(router) -> dict[str, torch.Tensor]:
    """The raw losses the router recorded in its last training forward."""
    return router.recorder.aux_losses()


def logits_of(router, hidden):
    return hidden.reshape(-1, H).double() @ router.weight.double().t()


def dense(idx, values, num_experts=E):
    return torch.zeros(idx.shape[0], num_experts, dtype=values.dtype).scatter(1, idx, values)


def one_hot_rows(idx, num_experts=E):
    return dense(idx, torch.ones(idx.shape, dtype=torch.float64), num_experts).bool()


def switch_reference(logits, topk, num_tokens=None, counts=None):
    """E * sum_e f_e * P_e from softmax scores and each token's plain top-k (Megatron's normalisation)."""
    scores = torch.softmax(logits, -1)
    if counts is None:
        counts = one_hot_rows(logits.topk(topk, -1).indices, logits.shape[1]).double().sum(0)
        num_tokens = logits.shape[0]
    return logits.shape[1] * (counts / (topk * num_tokens) * scores.mean(0)).sum()


@pytest.mark.parametrize("shape", [(2, 5, H), (10, H)], ids=["BSH", "NH"])
def test_softmax_topk_then_softmax(shape):
    router = make_router()
    hidden = torch.randn(*shape, dtype=torch.float64)
    probs, routing_map = router(hidden)
    top = logits_of(router, hidden).topk(K, dim=-1)
    expected = dense(top.indices, torch.exp(top.values) / torch.exp(top.values).sum(-1, keepdim=True))
    assert probs.dtype == torch.float32 and routing_map.dtype == torch.bool and probs.shape == (10, E)
    torch.testing.assert_close(probs.double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(routing_map, one_hot_rows(top.indices))
    assert torch.equal(probs != 0, routing_map), "exact zeros where not routed"


def test_pre_softmax_and_scaling_factor():
    router = make_router(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5)
    hidden = torch.randn(6, H, dtype=torch.float64)
    probs, _ = router(hidden)
    logits = logits_of(router, hidden)
    scores = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    top = scores.topk(K, dim=-1)
    torch.testing.assert_close(probs.double(), dense(top.indices, 2.5 * top.values), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("topk", [1, 3])
def test_sigmoid_normalised_only_when_topk_above_one(topk):
    router = make_router(moe_router_score_function="sigmoid", moe_router_topk=topk)
    hidden = torch.randn(6, H, dtype=torch.float64)
    probs, _ = router(hidden)
    top = (1 / (1 + torch.exp(-logits_of(router, hidden)))).topk(topk, dim=-1)
    values = top.values / top.values.sum(-1, keepdim=True) if topk > 1 else top.values
    torch.testing.assert_close(probs.double(), dense(top.indices, values), rtol=1e-6, atol=1e-7)


def router_with_logits(per_expert_logits, **kw):
    """A router whose logits are ``per_expert_logits`` for every token whose hidden is e_0."""
    router = make_router(**kw)
    router.weight.data.zero_()
    router.weight.data[:, 0] = torch.as_tensor(per_expert_logits, dtype=torch.float64)
    hidden = torch.zeros(5, H, dtype=torch.float64)
    hidden[:, 0] = 1.0
    return router, hidden


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_group_limited_topk_stays_in_best_groups(score_function):
    # Four groups of two. Expert 0 has the best logit but its group (0, 1) sums worse over its top-2
    # (topk // group_topk = 2) than group (6, 7), so with one group per token only experts 6 and 7 qualify.
    logits = [5.0, -5.0, 0.0, 0.0, 0.0, 0.0, 3.0, 3.0]
    router, hidden = router_with_logits(logits, moe_router_num_groups=4, moe_router_group_topk=1,
                                        moe_router_score_function=score_function)
    _, routing_map = router(hidden)
    assert routing_map[:, 6:].all() and not routing_map[:, :6].any()
    plain, _ = router_with_logits(logits, moe_router_score_function=score_function)
    assert plain(hidden)[1][:, 0].all(), "without group limits expert 0 is chosen: the test has power"


def test_group_limited_topk_random_tokens_never_leave_their_groups():
    router = make_router(num_moe_experts=16, moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4)
    hidden = torch.randn(64, H, dtype=torch.float64)
    _, routing_map = router(hidden)
    logits = logits_of(router, hidden).view(64, 4, 4)
    group_scores = logits.topk(2, dim=-1).values.sum(-1)  # topk // group_topk = 2 best per group
    allowed = one_hot_rows(group_scores.topk(2, -1).indices, 4)[:, :, None].expand(64, 4, 4).reshape(64, 16)
    assert not (routing_map & ~allowed).any() and (routing_map.sum(-1) == 4).all()
    masked = logits.reshape(64, 16).masked_fill(~allowed, float("-inf"))
    assert torch.equal(routing_map, one_hot_rows(masked.topk(4, -1).indices, 16))


def test_router_dtype():
    # Logits 1 and 1 + 1e-12 are equal in float32; fp64 routing must still pick expert 5.
    logits = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0 + 1e-12, 0.0, 0.0]
    router, hidden = router_with_logits(logits, moe_router_topk=1)
    assert router._logits(hidden.float()).dtype == torch.float64
    _, routing_map = router(hidden)
    assert routing_map[:, 5].all()
    hidden = torch.randn(4, H)
    fp32 = make_router(moe_router_dtype="fp32").float()
    assert fp32._logits(hidden.bfloat16()).dtype == torch.float32
    native = make_router(moe_router_dtype=None).float()
    torch.testing.assert_close(native._logits(hidden.bfloat16()),
                               (hidden.bfloat16() @ native.weight.bfloat16().t()).float(), rtol=0, atol=0)
    assert native(hidden.bfloat16())[0].dtype == torch.float32


def test_probs_gradient_matches_float64_reference():
    router = make_router()
    hidden = torch.randn(7, H, dtype=torch.float64)
    upstream = torch.randn(7, E, dtype=torch.float64)
    probs, routing_map = router(hidden)
    (probs.double() * upstream).sum().backward()
    w = router.weight.detach().clone().requires_grad_()
    logits = hidden @ w.t()
    top = logits.topk(K, -1)
    (dense(top.indices, torch.softmax(top.values, -1)) * upstream).sum().backward()
    # probs leave the router as float32, so the gradient they pass back is rounded to float32.
    torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_expert_bias_changes_selection_not_values(score_function):
    router = make_router(moe_router_score_function=score_function, moe_router_enable_expert_bias=True)
    hidden = torch.randn(16, H, dtype=torch.float64)
    _, map_before = router(hidden)
    router.expert_bias[3] = 1e3  # every token now picks expert 3
    probs, routing_map = router(hidden)
    assert routing_map[:, 3].all() and not torch.equal(routing_map, map_before)
    logits = logits_of(router, hidden)
    if score_function == "sigmoid":
        chosen = torch.sigmoid(logits) * routing_map
        expected = chosen / chosen.sum(-1, keepdim=True)
    else:
        expected = torch.softmax(logits.masked_fill(~routing_map, float("-inf")), -1)
    torch.testing.assert_close(probs.double(), expected, rtol=1e-6, atol=1e-7)


def test_update_expert_bias_moves_towards_balance_and_resets_counter():
    router = make_router(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1)
    router.expert_bias[3] = 50.0
    hidden = torch.randn(16, H, dtype=torch.float64)
    router(hidden)
    router(hidden)
    load = router.local_tokens_per_expert.clone()
    assert load[3] == 32 and load.sum() == 2 * 16 * K
    router.update_expert_bias()
    # Overloaded experts step down by the rate, underloaded ones step up.
    step = router.expert_bias - torch.tensor([0.0, 0, 0, 50.0, 0, 0, 0, 0])
    assert step[3].item() == pytest.approx(-0.1, abs=1e-5)
    mean = load.mean()
    torch.testing.assert_close(step, torch.where(load > mean, -0.1, torch.where(load < mean, 0.1, 0.0)),
                               rtol=0, atol=1e-5)
    assert torch.equal(router.local_tokens_per_expert, torch.zeros(E))


def test_expert_bias_buffers_stay_float32_and_counter_skips_eval():
    router = make_router(moe_router_enable_expert_bias=True).to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == router.local_tokens_per_expert.dtype == torch.float32
    router.expert_bias += 1.0
    router.expert_bias += 1e-3  # bf16 spaces its values 2^-7 apart near 1: the step would vanish
    assert router.expert_bias[0].item() == pytest.approx(1.001)
    assert "expert_bias" in router.state_dict() and "expert_bias" not in make_router().state_dict()
    router.eval()
    router(torch.randn(4, H, dtype=torch.bfloat16))
    with torch.no_grad():
        router.train()(torch.randn(4, H, dtype=torch.bfloat16))
    assert router.local_tokens_per_expert.sum() == 0, "only training forwards with grad count"


def test_aux_loss_value_and_gradient_through_scaler():
    router = make_router(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1)
    hidden = torch.randn(2, 6, H, dtype=torch.float64)
    upstream = torch.randn(12, E)
    probs, _ = router(hidden)
    expected = switch_reference(logits_of(router, hidden), K)
    torch.testing.assert_close(losses(router)["aux_loss"], expected, rtol=1e-9, atol=0)
    assert set(losses(router)) == {"aux_loss"}
    (probs * upstream).sum().backward()

    reference = make_router()
    ref_probs, _ = reference(hidden)
    assert not losses(reference)
    w = reference.weight
    ((ref_probs * upstream).sum() + 0.1 * switch_reference(hidden.reshape(12, H) @ w.t(), K)).backward()
    torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-6, atol=1e-9)


def test_aux_loss_scale_scales_the_aux_gradient_only():
    grads = {}
    for scale in (0.0, 1.0, 0.25):
        router = make_router(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1)
        router.aux_loss_scale = scale
        probs, _ = router(torch.ones(6, H, dtype=torch.float64).cumsum(0).sin())
        probs.pow(2).sum().backward()
        grads[scale] = router.weight.grad
    aux_grad = grads[1.0] - grads[0.0]
    assert aux_grad.abs().max() > 1e-4, "the aux loss has a gradient here: the test has power"
    torch.testing.assert_close(grads[0.25] - grads[0.0], 0.25 * aux_grad, rtol=1e-6, atol=1e-12)


def test_aux_loss_ignores_expert_bias():
    router = make_router(moe_router_enable_expert_bias=True, moe_router_load_balancing_type="aux_loss",
                         moe_aux_loss_coeff=1.0)
    hidden = torch.randn(8, H, dtype=torch.float64)
    router(hidden)
    unbiased = losses(router)["aux_loss"]
    router.expert_bias[0] = 1e3
    router(hidden)
    torch.testing.assert_close(losses(router)["aux_loss"], unbiased, rtol=0, atol=0)


def test_seq_aux_loss_per_sequence():
    router = make_router(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1)
    hidden = torch.randn(3, 4, H, dtype=torch.float64)
    router(hidden)
    logits = logits_of(router, hidden).view(3, 4, E)
    expected = torch.stack([switch_reference(logits[b], K) for b in range(3)]).mean()
    torch.testing.assert_close(losses(router)["seq_aux_loss"], expected, rtol=1e-9, atol=0)
    router(hidden.reshape(12, H))  # [N, H] is one sequence
    torch.testing.assert_close(losses(router)["seq_aux_loss"], switch_reference(logits.view(12, E), K),
                               rtol=1e-9, atol=0)


def test_global_aux_loss_accumulates_until_reset():
    router = make_router(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.2)
    h1, h2 = torch.randn(2, 3, 4, H, dtype=torch.float64)
    router(h1)
    l1 = logits_of(router, h1)
    torch.testing.assert_close(losses(router)["global_aux_loss"], switch_reference(l1, K), rtol=1e-9, atol=0)
    router(h2)
    l2 = logits_of(router, h2)
    counts = one_hot_rows(l1.topk(K, -1).indices).double().sum(0) + one_hot_rows(l2.topk(K, -1).indices).sum(0)
    expected = switch_reference(l2, K, num_tokens=24, counts=counts)
    torch.testing.assert_close(losses(router)["global_aux_loss"], expected, rtol=1e-9, atol=0)
    router.reset_global_aux_loss_tracker()
    router(h2)
    torch.testing.assert_close(losses(router)["global_aux_loss"], switch_reference(l2, K), rtol=1e-9, atol=0)


def test_global_aux_loss_reduces_counts_over_the_group(monkeypatch):
    group = object()
    calls = []

    def fake_all_reduce(tensor, group=None):
        calls.append(group)
        tensor.mul_(3)  # as if two more ranks had seen the same loads

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    torch.manual_seed(0)
    router = TopKRouter(make_config(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1.0),
                        tp_dp_group=group).double()
    hidden = torch.randn(6, H, dtype=torch.float64)
    router(hidden)
    assert calls == [group]
    logits = logits_of(router, hidden)
    counts = 3 * one_hot_rows(logits.topk(K, -1).indices).double().sum(0)
    expected = switch_reference(logits, K, num_tokens=18, counts=counts)
    torch.testing.assert_close(losses(router)["global_aux_loss"], expected, rtol=1e-9, atol=0)


def test_list_of_losses_with_list_of_coefficients():
    types = ["aux_loss", "seq_aux_loss", "none"]
    router = make_router(moe_router_load_balancing_type=types, moe_aux_loss_coeff=[0.1, 0.3, 0.5],
                         moe_z_loss_coeff=0.01)
    hidden = torch.randn(2, 5, H, dtype=torch.float64)
    probs, _ = router(hidden)
    assert set(losses(router)) == {"aux_loss", "seq_aux_loss", "z_loss"}
    probs.sum().backward()
    reference = make_router()
    w = reference.weight
    logits = hidden.reshape(10, H) @ w.t()
    ref_probs, _ = reference(hidden)
    seq = torch.stack([switch_reference(logits.view(2, 5, E)[b], K) for b in range(2)]).mean()
    z = torch.logsumexp(logits, -1).square().mean()
    (ref_probs.sum() + 0.1 * switch_reference(logits, K) + 0.3 * seq + 0.01 * z).backward()
    torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-6, atol=1e-9)


def test_z_loss_value_and_gradient():
    router = make_router(moe_z_loss_coeff=1e-2)
    router.aux_loss_scale = 0.5
    hidden = torch.randn(7, H, dtype=torch.float64)
    probs, _ = router(hidden)
    expected = torch.logsumexp(logits_of(router, hidden), -1).square().mean()
    torch.testing.assert_close(losses(router)["z_loss"], expected, rtol=1e-9, atol=0)  # raw, no coefficient
    (probs * 0).sum().backward()  # the probs carry no gradient: what reaches the weight is the z-loss's
    w = router.weight.detach().clone().requires_grad_()
    (0.5 * 1e-2 * torch.logsumexp(hidden @ w.t(), -1).square().mean()).backward()
    torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-9, atol=1e-15)


def test_losses_only_in_training_with_grad():
    router = make_router(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1,
                         moe_z_loss_coeff=0.1)
    hidden = torch.randn(6, H, dtype=torch.float64)
    router.eval()
    router(hidden)
    assert not router.recorder.losses.any() and router.global_num_tokens == 0
    router.train()
    with torch.no_grad():
        router(hidden)
    assert not router.recorder.losses.any() and router.global_num_tokens == 0
    router(hidden)
    assert set(losses(router)) == {"global_aux_loss", "z_loss"} and router.global_num_tokens == 6
    assert router.recorder.losses.all(), "the training forward with grad records its losses"


def test_input_jitter_only_in_training():
    router = make_router(moe_input_jitter_eps=0.5)
    plain = make_router()
    hidden = torch.randn(32, H, dtype=torch.float64)
    router.eval()
    assert torch.equal(router(hidden)[0], plain(hidden)[0])
    router.train()
    a, _ = router(hidden)
    b, _ = router(hidden)
    assert not torch.equal(a, b) and not torch.equal(a, plain(hidden)[0])


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_router_applies_capacity(policy, pad):
    router = make_router(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy,
                         moe_pad_expert_input_to_capacity=pad)
    plain = make_router()
    hidden = torch.randn(32, H, dtype=torch.float64)
    probs, routing_map = router(hidden)
    capacity = get_capacity(32, E, 0.5, topk=K)
    full_probs, full_map = plain(hidden)
    expected_probs, expected_map = apply_token_dropping(full_probs, full_map, capacity, policy, pad)
    assert torch.equal(routing_map, expected_map) and torch.equal(probs, expected_probs)
    kept = routing_map & full_map
    assert kept.sum() < full_map.sum(), "capacity factor 0.5 drops tokens here: the test has power"
    if pad:
        assert (routing_map.sum(0) == capacity).all()
    assert (routing_map.sum(0) <= capacity).all()
    assert torch.equal(router.recorder.tokens_per_expert, kept.sum(0).float())
    assert torch.equal(router.local_tokens_per_expert, kept.sum(0).float())


def test_empty_input():
    router = make_router(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1)
    probs, routing_map = router(torch.zeros(0, H, dtype=torch.float64))
    assert probs.shape == routing_map.shape == (0, E)
    assert all(torch.isfinite(v) for v in losses(router).values())


def test_bad_input_and_config_raise():
    with pytest.raises(ValueError, match="hidden"):
        make_router()(torch.randn(4, H + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="hidden"):
        make_router()(torch.randn(2, 2, 2, H, dtype=torch.float64))
    with pytest.raises(TypeError, match="hidden"):
        make_router()(torch.ones(4, H, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_moe_experts"):
        TopKRouter(make_config(num_moe_experts=None))
    with pytest.raises(ValueError, match="moe_router_group_topk"):
        make_config(moe_router_num_groups=4)
    with pytest.raises(ValueError, match="moe_router_score_function"):
        make_config(moe_router_score_function="relu")
    with pytest.raises(ValueError, match="moe_token_drop_policy"):
        make_config(moe_token_drop_policy="random")
    with pytest.raises(ValueError, match="moe_aux_loss_coeff"):
        make_config(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logits_under_autocast_equal_float32_bitwise(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                               moe_router_topk=2, moe_ffn_hidden_size=32)
    router = TopKRouter(config).to(device)
    hidden = torch.randn(50, 64, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = router._logits(hidden)
        probs, routing_map = router(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, hidden @ router.weight.t())
    want_probs, want_map = router(hidden)
    assert torch.equal(probs, want_probs) and torch.equal(routing_map, want_map)
    # Negative control: with moe_router_dtype None the logits GEMM follows autocast into bf16.
    router.router_dtype = None
    with torch.autocast(device, dtype=torch.bfloat16):
        lowered = router._logits(hidden)
    assert not torch.equal(lowered, hidden @ router.weight.t())
