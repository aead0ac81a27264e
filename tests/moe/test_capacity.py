"""Capacity and token dropping: Megatron's formula, exact kept sets for both policies, padding, errors."""

import math

import pytest
import torch

from moe_core.moe.capacity import apply_token_dropping, get_capacity


def test_get_capacity_formula():
    assert get_capacity(10, 4, 1.0) == 3  # ceil(2.5)
    assert get_capacity(5, 4, 1.0, topk=2) == get_capacity(10, 4, 1.0) == 3
    assert get_capacity(8, 8, 1.5, topk=2) == 3
    assert get_capacity(0, 4, 1.0) == 0
    assert get_capacity(10, 4, 0.1, min_capacity=2) == 2
    # Megatron's order of operations, (rows / experts) * factor: 100 / 10 * 1.1 = 11.0, while
    # 100 * 1.1 / 10 = 11.000000000000002 would round up to 12.
    assert get_capacity(100, 10, 1.1) == get_capacity(50, 10, 1.1, topk=2) == 11
    assert math.ceil(100 * 1.1 / 10) == 12


@pytest.mark.parametrize("args, match", [
    ((10, 0, 1.0), "num_experts"),
    ((-1, 4, 1.0), "num_tokens"),
    ((10, 4, 0.0), "capacity_factor"),
    ((10, 4, 1.0, 0), "topk"),
])
def test_get_capacity_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        get_capacity(*args)


ROUTING_MAP = torch.tensor([[1, 0, 1], [1, 0, 0], [1, 1, 0], [1, 0, 1], [0, 0, 1]], dtype=torch.bool)
PROBS = torch.tensor([[0.1, 0.0, 0.9], [0.9, 0.0, 0.0], [0.5, 0.5, 0.0], [0.7, 0.0, 0.3], [0.0, 0.0, 1.0]])


def column_sets(routing_map):
    return [set(routing_map[:, e].nonzero().flatten().tolist()) for e in range(routing_map.shape[1])]


def test_drop_by_probs_keeps_highest_probs():
    probs, routing_map = apply_token_dropping(PROBS, ROUTING_MAP, 2, "probs")
    # Expert 0: tokens 0..3 with probs .1 .9 .5 .7 -> keep 1 and 3; expert 1 under capacity; expert 2: .9 .3 1.
    assert column_sets(routing_map) == [{1, 3}, {2}, {0, 4}]
    assert torch.equal(probs, PROBS * routing_map)


def test_drop_by_position_keeps_earliest():
    probs, routing_map = apply_token_dropping(PROBS, ROUTING_MAP, 2, "position")
    assert column_sets(routing_map) == [{0, 1}, {2}, {0, 3}]
    assert torch.equal(probs, PROBS * routing_map)


def test_pad_to_capacity_fills_with_zero_prob_padding():
    probs, routing_map = apply_token_dropping(PROBS, ROUTING_MAP, 2, "position", pad_to_capacity=True)
    assert routing_map.sum(dim=0).tolist() == [2, 2, 2]
    kept = routing_map & ROUTING_MAP
    assert column_sets(kept) == [{0, 1}, {2}, {0, 3}]
    assert torch.equal(probs, PROBS * kept)  # padding entries are exact zeros
    _, big = apply_token_dropping(PROBS, ROUTING_MAP, 9, "probs", pad_to_capacity=True)
    assert big.all(), "capacity > N: every token fills every expert"


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_bounds(policy):
    torch.manual_seed(0)
    routing_map = torch.rand(41, 7) < 0.5
    probs = torch.rand(41, 7) * routing_map
    for capacity in (0, 3, 41, 50):
        new_probs, new_map = apply_token_dropping(probs, routing_map, capacity, policy)
        counts = new_map.sum(dim=0)
        assert (counts <= capacity).all() and not (new_map & ~routing_map).any()
        assert torch.equal(counts, routing_map.sum(dim=0).clamp(max=capacity)), "drops only the excess"
        assert torch.equal(new_probs, probs * new_map)


def test_gradient_reaches_kept_entries_only():
    probs = PROBS.clone().requires_grad_()
    out, routing_map = apply_token_dropping(probs, ROUTING_MAP, 2, "probs")
    out.sum().backward()
    assert torch.equal(probs.grad, routing_map.float())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="drop_policy"):
        apply_token_dropping(PROBS, ROUTING_MAP, 2, "random")
    with pytest.raises(TypeError, match="routing_map"):
        apply_token_dropping(PROBS, ROUTING_MAP.int(), 2)
    with pytest.raises(ValueError, match="probs / routing_map"):
        apply_token_dropping(PROBS[:4], ROUTING_MAP, 2)
    with pytest.raises(ValueError, match="capacity"):
        apply_token_dropping(PROBS, ROUTING_MAP, -1)
