"""Load-balancing losses, z-loss and MoEAuxLossAutoScaler against hand-written float64 formulas."""

import pytest
import torch

from moe_core.moe.load_balancing import (
    MoEAuxLossAutoScaler,
    routing_scores_for_aux_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    z_loss,
)

T, E, K = 12, 6, 2


def switch_reference(scores, routing_map, topk):
    """Switch Transformer eq. 4 with K rows per token: E * sum_e f_e * P_e."""
    num_tokens = scores.shape[0]
    f = routing_map.double().sum(0) / (num_tokens * topk)
    p = scores.double().mean(0)
    return scores.shape[1] * (f * p).sum()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_routing_scores_for_aux_loss(score_function):
    logits = torch.randn(T, E, dtype=torch.float64)
    scores, routing_map = routing_scores_for_aux_loss(logits, score_function, K)
    raw = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    torch.testing.assert_close(scores, raw / raw.sum(-1, keepdim=True), rtol=1e-12, atol=1e-15)
    expected_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, logits.topk(K, -1).indices, True)
    assert torch.equal(routing_map, expected_map)
    with pytest.raises(ValueError, match="score_function"):
        routing_scores_for_aux_loss(logits, "relu", K)


def test_switch_loss_matches_formula_and_bounds():
    scores = torch.softmax(torch.randn(T, E, dtype=torch.float64), -1)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, scores.topk(K, -1).indices, True)
    loss = switch_load_balancing_loss(scores, routing_map.sum(0), T, K)
    torch.testing.assert_close(loss, switch_reference(scores, routing_map, K), rtol=1e-12, atol=0)
    uniform = torch.full((T, E), 1.0 / E, dtype=torch.float64)
    assert switch_load_balancing_loss(uniform, torch.full((E,), T * K / E), T, K).item() == pytest.approx(1.0)
    collapsed = torch.zeros(T, E, dtype=torch.float64)
    collapsed[:, :K] = 1.0 / K
    counts = torch.zeros(E)
    counts[:K] = T
    assert switch_load_balancing_loss(collapsed, counts, T, K).item() == pytest.approx(E / K)
    assert switch_load_balancing_loss(scores[:0], counts * 0, 0, K).item() == 0.0


def test_switch_loss_with_counts_from_more_tokens():
    """Global form: f from 3 * T tokens' counts, P from this forward's T tokens."""
    scores = torch.softmax(torch.randn(T, E, dtype=torch.float64), -1)
    counts = torch.randint(0, 10, (E,)).double()
    loss = switch_load_balancing_loss(scores, counts, 3 * T, K)
    expected = E * (counts / (K * 3 * T) * scores.mean(0)).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)


def test_sequence_loss_is_mean_of_per_sequence_switch_losses():
    scores = torch.softmax(torch.randn(3, 5, E, dtype=torch.float64), -1)
    routing_map = torch.zeros(3, 5, E, dtype=torch.bool).scatter(2, scores.topk(K, -1).indices, True)
    loss = sequence_load_balancing_loss(scores, routing_map, K)
    expected = torch.stack([switch_reference(scores[b], routing_map[b], K) for b in range(3)]).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    flat = switch_reference(scores.view(15, E), routing_map.view(15, E), K)
    assert not torch.isclose(loss, flat), "per-sequence differs from the batch loss here: the test has power"


def test_z_loss_value_and_gradient():
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    loss = z_loss(logits)
    lse = torch.log(torch.exp(logits.detach()).sum(-1))
    torch.testing.assert_close(loss, lse.square().mean(), rtol=1e-12, atol=0)
    loss.backward()
    # d/dx mean(lse^2) = 2 * lse * softmax / T
    expected = 2 * lse[:, None] * torch.softmax(logits.detach(), -1) / T
    torch.testing.assert_close(logits.grad, expected, rtol=1e-12, atol=1e-15)
    assert z_loss(torch.zeros(0, E)).item() == 0.0


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.0])
def test_auto_scaler_forward_identity_backward_adds_scaled_loss(scale):
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 3, dtype=torch.float64)

    def aux(w_):
        return (w_ ** 3).sum()

    out = MoEAuxLossAutoScaler.apply(x * 2.0, aux(w), scale)
    assert torch.equal(out, x.detach() * 2.0)
    (out * upstream).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    ((x2 * 2.0 * upstream).sum() + scale * aux(w2)).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=0)
