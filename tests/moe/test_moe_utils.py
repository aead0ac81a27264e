"""permute / unpermute and the single-rank token dispatcher against per-token loop references.

Legend: T tokens, H hidden, E experts, K slots per token, C capacity per expert, R permuted rows.
"""

import dataclasses

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.moe.capacity import apply_token_dropping, get_capacity
from moe_core.moe.dispatcher_factory import build_token_dispatcher
from moe_core.moe.moe_utils import permute, unpermute
from moe_core.moe.token_dispatcher import MoELocalTokenDispatcher, MoETokenDispatcher
from moe_core.ops.pack import packed_values


def make_config(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=8, num_attention_heads=2, num_moe_experts=5, moe_router_topk=2,
                moe_ffn_hidden_size=6)
    return TransformerConfig(**{**base, **kw})


def random_routing(num_tokens: int, num_experts: int, topk: int, seed: int, empty_expert: int | None = None):
    """routing_map [N, E] with exactly topk experts per token (never ``empty_expert``), probs [N, E]."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    if empty_expert is not None:
        scores[:, empty_expert] = -1.0
    idx = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.rand(num_tokens, num_experts, generator=g, dtype=torch.float64) * routing_map
    return routing_map, probs


def loop_permutation(routing_map: torch.Tensor) -> list[int]:
    """Token of each permuted row, expert-major then token order, by plain loops."""
    num_tokens, num_experts = routing_map.shape
    return [n for e in range(num_experts) for n in range(num_tokens) if routing_map[n, e]]


def loop_combine(x: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """out[n] = sum over routed e of probs[n, e] * x[n], one token at a time."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for e in range(routing_map.shape[1]):
            if routing_map[n, e]:
                out[n] += probs[n, e] * x[n]
    return out


@pytest.mark.parametrize("static", [False, True], ids=["nonzero", "num_out_tokens"])
@pytest.mark.parametrize("num_tokens,num_experts,topk", [(1, 1, 1), (7, 5, 2), (13, 4, 3), (0, 3, 1)])
def test_permute_matches_loop_reference(static, num_tokens, num_experts, topk):
    routing_map, probs = random_routing(num_tokens, num_experts, topk, seed=num_tokens,
                                        empty_expert=1 if num_experts > topk else None)
    tokens = torch.randn(num_tokens, 3, dtype=torch.float64)
    num_out = num_tokens * topk if static else None
    permuted, permuted_probs, row_map = permute(tokens, routing_map, probs, num_out_tokens=num_out, num_slots=topk)
    sorted_indices = row_map.token_of_row

    expected = loop_permutation(routing_map)
    assert sorted_indices.dtype == torch.int64
    assert sorted_indices.tolist() == expected
    assert torch.equal(permuted, tokens[expected])
    assert torch.equal(permuted_probs, torch.stack([probs[n, e] for e in range(num_experts)
                                                    for n in range(num_tokens) if routing_map[n, e]])
                       if expected else probs.new_zeros(0))
    # Expert-major: the first count_0 rows belong to expert 0, the next count_1 to expert 1, ...
    counts = routing_map.sum(0).tolist()
    for e, rows in enumerate(sorted_indices.split(counts)):
        assert routing_map[rows, e].all()
    # row_of_slot inverts it: token n's slots hold its rows in expert order.
    for n in range(num_tokens):
        rows = [r for r, t in enumerate(expected) if t == n]
        assert row_map.row_of_slot[n].tolist() == rows + [-1] * (topk - len(rows))


def test_permute_row_order_by_hand():
    routing_map = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 0, 0]], dtype=torch.bool)
    tokens = torch.tensor([[10.0], [11.0], [12.0]])
    permuted, _, row_map = permute(tokens, routing_map, num_slots=2)
    assert row_map.token_of_row.tolist() == [0, 2, 0, 1]  # expert 0: tokens 0, 2; expert 1: none; expert 2: 0, 1
    assert row_map.row_of_slot.tolist() == [[0, 2], [3, -1], [1, -1]]
    assert permuted.flatten().tolist() == [10.0, 12.0, 10.0, 11.0]
    assert unpermute(permuted, row_map).flatten().tolist() == [20.0, 11.0, 12.0]


def test_unpermute_round_trip_and_grads():
    routing_map, probs = random_routing(11, 5, 2, seed=3, empty_expert=4)
    routing_map[4] = False  # a token routed nowhere must come back as zeros
    probs[4] = 0
    tokens = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    probs.requires_grad_(True)
    permuted, permuted_probs, row_map = permute(tokens, routing_map, probs, num_slots=2)
    out = unpermute(permuted * permuted_probs.unsqueeze(-1), row_map)
    ref = loop_combine(tokens, routing_map, probs)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)
    assert torch.equal(out[4], torch.zeros(6, dtype=torch.float64))
    # Without probs the round trip counts each token's experts.
    plain = unpermute(permuted, row_map)
    torch.testing.assert_close(plain, tokens * routing_map.sum(1, keepdim=True), rtol=0, atol=1e-15)

    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (tokens, probs), grad)
    want = torch.autograd.grad(ref, (tokens, probs), grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-14)


@pytest.mark.parametrize("num_tokens,capacity", [(9, 3), (4, 6)], ids=["C<N", "C>N"])
def test_drop_and_pad_static_shapes(num_tokens, capacity):
    num_experts = 4
    routing_map, probs = random_routing(num_tokens, num_experts, 2, seed=capacity, empty_expert=2)
    probs, routing_map = apply_token_dropping(probs, routing_map, capacity, "probs", pad_to_capacity=False)
    tokens = torch.randn(num_tokens, 5, dtype=torch.float64)
    permuted, permuted_probs, row_map = permute(
        tokens, routing_map, probs, num_out_tokens=num_experts * capacity, drop_and_pad=True
    )
    sorted_indices = row_map.token_of_row
    assert permuted.shape == (num_experts * capacity, 5)
    assert permuted_probs.shape == sorted_indices.shape == (num_experts * capacity,)
    padding = sorted_indices < 0
    assert torch.equal(permuted[~padding], tokens[sorted_indices[~padding]])
    assert torch.equal(permuted[padding], torch.zeros_like(permuted[padding]))  # padding rows: exact zeros
    for e in range(num_experts):
        rows = slice(e * capacity, (e + 1) * capacity)
        routed = [n for n in range(num_tokens) if routing_map[n, e]]
        assert len(routed) <= capacity
        assert sorted_indices[rows][:len(routed)].tolist() == routed
        assert torch.equal(permuted_probs[rows][:len(routed)], probs[routed, e])
        assert torch.equal(permuted_probs[rows][len(routed):], torch.zeros(capacity - len(routed), dtype=torch.float64))
        assert sorted_indices[rows][len(routed):].tolist() == [-1] * (capacity - len(routed))
    out = unpermute(permuted * permuted_probs.unsqueeze(-1), row_map)
    torch.testing.assert_close(out, loop_combine(tokens, routing_map, probs), rtol=0, atol=1e-15)


def test_permute_rejects_bad_inputs():
    routing_map, probs = random_routing(6, 3, 1, seed=0)
    tokens = torch.randn(6, 2)
    with pytest.raises(ValueError, match="num_out_tokens"):
        permute(tokens, routing_map, probs, num_out_tokens=5)
    with pytest.raises(ValueError, match="num_out_tokens"):
        permute(tokens, routing_map, probs, num_out_tokens=7, drop_and_pad=True)
    with pytest.raises(TypeError, match="routing_map"):
        permute(tokens, routing_map.int(), probs)
    with pytest.raises(ValueError, match="routing_map"):
        permute(tokens[:5], routing_map, probs)
    with pytest.raises(ValueError, match="probs"):
        permute(tokens, routing_map, probs[:, :2])
    with pytest.raises(ValueError, match="num_slots"):
        permute(tokens, routing_map | routing_map.roll(1, dims=1), num_slots=1)
    _, _, row_map = permute(tokens, routing_map, num_slots=1)
    with pytest.raises(ValueError, match="token_of_row"):
        unpermute(tokens[:5], row_map)
    with pytest.raises(ValueError, match="pack_probs=True needs probs"):
        permute(tokens, routing_map, pack_probs=True)


def test_permute_packs_the_probs_into_the_rows():
    routing_map, probs = random_routing(9, 5, 2, seed=4)
    tokens = torch.randn(9, 6)
    permuted, permuted_probs, row_map = permute(tokens, routing_map, probs, num_slots=2)
    packed, none, packed_map = permute(tokens, routing_map, probs, num_slots=2, pack_probs=True)
    assert none is None and torch.equal(packed_map.token_of_row, row_map.token_of_row)
    assert torch.equal(packed[:, :6], permuted)
    assert torch.equal(packed_values(packed, 6, 1)[:, 0], permuted_probs.float())


def dispatch_reference_check(dispatcher, hidden, probs, routing_map, expected_rows):
    permuted, tokens_per_expert, permuted_probs, meta = dispatcher.dispatch(hidden, probs, routing_map)
    assert tokens_per_expert.dtype == torch.int64 and tokens_per_expert.device == hidden.device
    assert permuted_probs.dtype == torch.float32
    assert permuted.shape == (expected_rows, hidden.shape[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.row_map = None
    out = dispatcher.combine(permuted * permuted_probs.unsqueeze(-1).to(permuted.dtype), meta)
    return tokens_per_expert, out


@pytest.mark.parametrize("capacity_factor,pad", [(None, False), (1.0, False), (1.0, True)],
                         ids=["no-drop", "drop", "drop-and-pad"])
def test_local_dispatcher(capacity_factor, pad):
    config = make_config(moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=pad)
    dispatcher = build_token_dispatcher(config)
    assert isinstance(dispatcher, MoELocalTokenDispatcher) and isinstance(dispatcher, MoETokenDispatcher)
    num_tokens, num_experts = 10, config.num_moe_experts
    routing_map, probs = random_routing(num_tokens, num_experts, 2, seed=5, empty_expert=0)
    probs = probs.float()
    if capacity_factor is not None:
        capacity = get_capacity(num_tokens * 2, num_experts, capacity_factor)
        probs, routing_map = apply_token_dropping(probs, routing_map, capacity, "probs", pad_to_capacity=pad)
    hidden = torch.randn(num_tokens, 8)
    rows = num_experts * dispatcher.capacity(num_tokens) if pad else int(routing_map.sum())
    tokens_per_expert, out = dispatch_reference_check(dispatcher, hidden, probs, routing_map, rows)
    if pad:
        assert tokens_per_expert.tolist() == [dispatcher.capacity(num_tokens)] * num_experts
    else:
        assert tokens_per_expert.tolist() == routing_map.sum(0).tolist()
        assert tokens_per_expert[0] == 0
    torch.testing.assert_close(out, loop_combine(hidden, routing_map, probs), rtol=1e-6, atol=1e-6)


def test_local_dispatcher_rejects_bad_inputs():
    dispatcher = MoELocalTokenDispatcher(make_config())
    routing_map, probs = random_routing(4, 5, 2, seed=1)
    with pytest.raises(ValueError, match="hidden"):
        dispatcher.dispatch(torch.randn(2, 4, 8), probs, routing_map)
    with pytest.raises(ValueError, match="probs and routing_map"):
        dispatcher.dispatch(torch.randn(4, 8), probs[:, :4], routing_map)
    with pytest.raises(TypeError, match="routing_map"):
        dispatcher.dispatch(torch.randn(4, 8), probs, routing_map.long())
    routing_map[0] = True  # 5 experts for token 0, but topk is 2
    with pytest.raises(ValueError, match="num_slots"):
        dispatcher.dispatch(torch.randn(4, 8), probs, routing_map)


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [False, True], ids=["no-drop", "drop-and-pad"])
def test_local_dispatcher_has_no_host_sync_on_gpu(pad):
    config = make_config(moe_expert_capacity_factor=1.0 if pad else None, moe_pad_expert_input_to_capacity=pad)
    dispatcher = MoELocalTokenDispatcher(config)
    routing_map, probs = random_routing(64, config.num_moe_experts, 2, seed=7, empty_expert=3)
    if pad:
        capacity = dispatcher.capacity(64)
        probs, routing_map = apply_token_dropping(probs, routing_map, capacity, "probs", pad_to_capacity=True)
    routing_map, probs = routing_map.cuda(), probs.float().cuda().requires_grad_(True)
    hidden = torch.randn(64, 8, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        permuted, tokens_per_expert, permuted_probs, meta = dispatcher.dispatch(hidden, probs, routing_map)
        out = dispatcher.combine(permuted * permuted_probs.unsqueeze(-1), meta)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out.cpu(), loop_combine(hidden.detach().cpu(), routing_map.cpu(), probs.detach().cpu()))
    assert tokens_per_expert.is_cuda
