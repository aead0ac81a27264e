"""TopKRouter: each knob against a hand-computed float64 reference, aux losses and their gradients, capacity."""

import math

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.moe.load_balancing import switch_load_balancing_loss
from moe_core.moe.moe_utils import apply_token_dropping, get_capacity
from moe_core.moe.router import TopKRouter

H, E = 8, 8


def make_router(**kw) -> TopKRouter:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=2,
                moe_router_dtype="fp64")
    torch.manual_seed(0)
    return TopKRouter(TransformerConfig(**{**base, **kw})).double()


def logits_of(router, hidden):
    return hidden.reshape(-1, H).double() @ router.weight.double().t()


def dense(idx, values, num_experts=E):
    return torch.zeros(idx.shape[0], num_experts, dtype=values.dtype).scatter(1, idx, values)


def test_softmax_topk_then_softmax():
    router = make_router()
    hidden = torch.randn(2, 5, H, dtype=torch.float64)
    probs, routing_map = router(hidden)
    logits = logits_of(router, hidden)
    top = logits.topk(2, dim=-1)
    torch.testing.assert_close(probs.double(), dense(top.indices, torch.softmax(top.values, -1)), rtol=1e-6, atol=1e-7)
    assert torch.equal(routing_map, dense(top.indices, torch.ones_like(top.values)).bool())
    assert probs.dtype == torch.float32 and routing_map.dtype == torch.bool and probs.shape == (10, E)


def test_pre_softmax_and_scaling_factor():
    router = make_router(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5)
    hidden = torch.randn(6, H, dtype=torch.float64)
    probs, _ = router(hidden)
    scores = torch.softmax(logits_of(router, hidden), -1)
    top = scores.topk(2, dim=-1)
    torch.testing.assert_close(probs.double(), dense(top.indices, 2.5 * top.values), rtol=1e-6, atol=1e-7)


def test_sigmoid_normalised_over_topk():
    router = make_router(moe_router_score_function="sigmoid")
    hidden = torch.randn(6, H, dtype=torch.float64)
    probs, _ = router(hidden)
    scores = torch.sigmoid(logits_of(router, hidden))
    top = scores.topk(2, dim=-1)
    torch.testing.assert_close(probs.double(), dense(top.indices, top.values / top.values.sum(-1, keepdim=True)),
                               rtol=1e-6, atol=1e-7)


def test_group_limited_topk_stays_in_best_groups():
    router = make_router(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_score_function="sigmoid")
    # Expert 0 alone has the best score, but its group (0, 1) holds the second-worst expert; group (6, 7)
    # has the best sum of its top-2 (topk // group_topk = 2), so only experts 6 and 7 may be chosen.
    bias_logits = torch.tensor([5.0, -5.0, 0.0, 0.0, 0.0, 0.0, 3.0, 3.0], dtype=torch.float64)
    router.weight.data = torch.zeros(E, H, dtype=torch.float64)
    hidden = torch.zeros(5, H, dtype=torch.float64)
    hidden[:, 0] = 1.0
    router.weight.data[:, 0] = bias_logits
    _, routing_map = router(hidden)
    assert routing_map[:, 6:].all() and not routing_map[:, :6].any()
    plain = make_router(moe_router_score_function="sigmoid")
    plain.weight.data = router.weight.data.clone()
    _, plain_map = plain(hidden)
    assert plain_map[:, 0].all(), "without group limits expert 0 is chosen: the test has power"


def test_router_dtype_fp64_and_fp32():
    hidden = torch.randn(4, H, dtype=torch.float32)
    router = make_router().float()
    router.router_dtype = torch.float64
    assert router._logits(hidden).dtype == torch.float64
    router32 = make_router(moe_router_dtype="fp32").float()
    assert router32._logits(hidden.bfloat16()).dtype == torch.float32


def test_expert_bias_changes_selection_not_values_and_updates():
    router = make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_bias_update_rate=0.1)
    hidden = torch.randn(16, H, dtype=torch.float64)
    probs_before, map_before = router(hidden)
    router.expert_bias[3] = 10.0  # now every token picks expert 3
    router.local_tokens_per_expert.zero_()
    probs, routing_map = router(hidden)
    assert routing_map[:, 3].all() and not torch.equal(routing_map, map_before)
    scores = torch.sigmoid(logits_of(router, hidden))
    chosen = scores * routing_map
    torch.testing.assert_close(probs.double(), chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    load = router.local_tokens_per_expert.clone()
    assert load[3] == 16 and load.sum() == 32
    router.update_expert_bias()
    expected_step = 0.1 * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.0] * 3 + [10.0] + [0.0] * 4) + expected_step)
    assert torch.equal(router.local_tokens_per_expert, torch.zeros(E))


def switch_reference(scores, routing_map, topk, coeff):
    num_tokens, num_experts = scores.shape
    f = routing_map.double().sum(0) / (num_tokens * topk)
    p = scores.double().mean(0)
    return coeff * num_experts * (f * p).sum()


def test_aux_loss_value_and_gradient_through_scaler():
    router = make_router(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1)
    hidden = torch.randn(2, 6, H, dtype=torch.float64)
    probs, routing_map = router(hidden)
    scores = torch.softmax(logits_of(router, hidden), -1)
    expected = switch_reference(scores, routing_map, 2, 0.1)
    torch.testing.assert_close(router.aux_losses["aux_loss"].double(), expected, rtol=1e-6, atol=1e-9)
    assert math.isclose(switch_load_balancing_loss(torch.full((4, 4), 0.25), torch.full((4,), 2.0), 4, 2, 1.0), 1.0)

    upstream = torch.randn_like(probs)
    (probs * upstream).sum().backward()
    grad_with_scaler = router.weight.grad.clone()
    reference = make_router(moe_router_load_balancing_type="none")
    reference.weight.data = router.weight.data.clone()
    ref_probs, ref_map = reference(hidden)
    ref_scores = torch.softmax(logits_of(reference, hidden), -1)
    ((ref_probs * upstream).sum() + switch_reference(ref_scores, ref_map, 2, 0.1)).backward()
    torch.testing.assert_close(grad_with_scaler, reference.weight.grad, rtol=1e-6, atol=1e-9)

    router.weight.grad = None
    router.aux_loss_scale = 0.0
    probs, _ = router(hidden)
    (probs * upstream).sum().backward()
    no_aux = router.weight.grad.clone()
    assert not torch.allclose(no_aux, grad_with_scaler), "aux_loss_scale scales the aux gradient"


def test_seq_and_global_aux_losses_and_lists():
    router = make_router(moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"],
                         moe_aux_loss_coeff=[0.1, 0.2])
    hidden = torch.randn(3, 4, H, dtype=torch.float64)
    _, routing_map = router(hidden)
    scores = torch.softmax(logits_of(router, hidden), -1)
    per_seq = [switch_reference(scores.view(3, 4, E)[b], routing_map.view(3, 4, E)[b], 2, 0.1) for b in range(3)]
    torch.testing.assert_close(router.aux_losses["seq_aux_loss"].double(), torch.stack(per_seq).mean(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(router.aux_losses["global_aux_loss"].double(), switch_reference(scores, routing_map, 2, 0.2),
                               rtol=1e-6, atol=1e-9)
    hidden2 = torch.randn(3, 4, H, dtype=torch.float64)
    _, map2 = router(hidden2)
    scores2 = torch.softmax(logits_of(router, hidden2), -1)
    counts = routing_map.sum(0).double() + map2.sum(0).double()
    expected = 0.2 * E / (2 * 12 * 24) * (scores2.sum(0) * counts).sum()
    torch.testing.assert_close(router.aux_losses["global_aux_loss"].double(), expected, rtol=1e-6, atol=1e-9)
    router.reset_global_aux_loss_tracker()
    assert router.global_num_tokens.item() == 0


def test_z_loss_value_and_gradient():
    router = make_router(moe_z_loss_coeff=1e-2, moe_router_load_balancing_type="none")
    hidden = torch.randn(7, H, dtype=torch.float64)
    probs, _ = router(hidden)
    logits = logits_of(router, hidden)
    expected = 1e-2 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(router.aux_losses["z_loss"].double(), expected, rtol=1e-6, atol=1e-12)
    probs.sum().backward()  # probs' own gradient is ~0 (softmax rows sum to 1): what remains is the z-loss's
    w = router.weight.detach().clone().requires_grad_()
    (1e-2 * torch.logsumexp(hidden @ w.t(), -1).square().mean()).backward()
    torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-5, atol=1e-9)


def test_input_jitter_only_in_training():
    router = make_router(moe_input_jitter_eps=0.5)
    hidden = torch.randn(32, H, dtype=torch.float64)
    router.eval()
    a, _ = router(hidden)
    b, _ = router(hidden)
    assert torch.equal(a, b)
    router.train()
    c, _ = router(hidden)
    assert not torch.equal(a, c)


def test_capacity_dropping_policies():
    assert get_capacity(num_tokens=10, num_experts=4, capacity_factor=1.0) == 3
    assert get_capacity(10, 4, 0.1, min_capacity=2) == 2
    routing_map = torch.tensor([[1, 0], [1, 0], [1, 1], [1, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.1, 0.0], [0.9, 0.0], [0.5, 0.5], [0.7, 0.0]])
    by_probs, map_p = apply_token_dropping(probs, routing_map, 2, "probs")
    assert map_p[:, 0].tolist() == [False, True, False, True] and map_p[:, 1].tolist() == [False, False, True, False]
    assert torch.equal(by_probs, probs * map_p)
    _, map_pos = apply_token_dropping(probs, routing_map, 2, "position")
    assert map_pos[:, 0].tolist() == [True, True, False, False]
    _, padded = apply_token_dropping(probs, routing_map, 2, "position", pad_to_capacity=True)
    assert padded.sum(0).tolist() == [2, 2]
    with pytest.raises(ValueError, match="drop_policy"):
        apply_token_dropping(probs, routing_map, 2, "random")


def test_router_applies_capacity():
    router = make_router(moe_expert_capacity_factor=0.5)
    probs, routing_map = router(torch.randn(32, H, dtype=torch.float64))
    assert routing_map.sum(0).max() <= get_capacity(32 * 2, E, 0.5)
    assert torch.equal(probs > 0, routing_map)


def test_bad_hidden_shape():
    with pytest.raises(ValueError, match="hidden"):
        make_router()(torch.randn(4, H + 1, dtype=torch.float64))
