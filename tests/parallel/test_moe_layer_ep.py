"""moe_core's MoELayer (TopKRouter + dispatcher + GroupedMLP + shared expert) under EP equals the
single-process MoELayer: output, input gradient and every parameter gradient, for both dispatchers, every
forced routing, biases on, and with token dropping / drop_and_pad."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moe_core.config import TransformerConfig
from moe_core.moe.moe_layer import MoELayer
from tests.parallel._common import all_reduce_sum, compare, groups
from tests.parallel._launch import RankFailure, device, run_distributed
from tests.parallel._models import (
    CAPACITY,
    GLOBAL_TOKENS,
    NUM_EXPERTS,
    SCENARIOS,
    forced_probs,
    forced_routing,
    is_expert_name,
    token_counts,
)


def layer_config(topk: int, dispatcher: str, ep: int = 1, **kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=NUM_EXPERTS, moe_router_topk=topk,
        moe_ffn_hidden_size=8, add_bias_linear=True, moe_shared_expert_intermediate_size=8,
        moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep, **kw,
    )


def force_routing(layer: MoELayer, routing_map: torch.Tensor) -> None:
    """Replace the router's top-k choice by ``routing_map``; its weight still gets gradients via softmax."""
    layer.router._topk_routing = lambda logits: (forced_probs(logits, routing_map), routing_map)


def ep_state(full: dict[str, torch.Tensor], ep_rank: int, num_local: int) -> dict[str, torch.Tensor]:
    return {k: v[ep_rank * num_local:(ep_rank + 1) * num_local] if is_expert_name(k) else v for k, v in full.items()}


def _layer(scenario: str, dispatcher: str, capacity: str | None, overlap: bool = False, sync_free: bool = False,
           compiled: bool = False) -> dict:
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    pg = groups(world, NUM_EXPERTS)
    sc = SCENARIOS[scenario]
    torch.manual_seed(0)
    ref = MoELayer(layer_config(sc.topk, dispatcher, **CAPACITY[capacity])).to(dev)
    model = MoELayer(layer_config(sc.topk, dispatcher, ep=world, moe_shared_expert_overlap=overlap,
                                  moe_dispatch_sync_free=sync_free, **CAPACITY[capacity]), pg).to(dev)
    assert model.shared_experts.overlap == overlap
    side_stream_calls = []
    on_side_stream = model.shared_experts._start_on_side_stream
    model.shared_experts._start_on_side_stream = lambda h: side_stream_calls.append(1) or on_side_stream(h)
    num_local = model.num_local_experts
    model.load_state_dict(ep_state(ref.state_dict(), pg.ep_rank, num_local))
    counts = token_counts(sc, GLOBAL_TOKENS, world)
    start, stop = sum(counts[:rank]), sum(counts[:rank + 1])
    routing = forced_routing(sc, GLOBAL_TOKENS, world, world, NUM_EXPERTS).to(dev)
    x_all = torch.randn(GLOBAL_TOKENS, 16, generator=torch.Generator().manual_seed(5)).to(dev)

    x = x_all[start:stop].clone().requires_grad_()
    force_routing(model, routing[start:stop])
    out = (torch.compile(model, fullgraph=True) if compiled else model)(x.unsqueeze(0))
    out.pow(2).sum().backward()

    # Capacity is per rank (each rank drops among its own tokens): the reference runs rank by rank then.
    pieces = counts if capacity is not None else [GLOBAL_TOKENS]
    x_ref = x_all.clone().requires_grad_()
    outs = []
    for chunk, rm in zip(x_ref.split(pieces), routing.split(pieces), strict=True):
        force_routing(ref, rm)
        outs.append(ref(chunk.unsqueeze(0)).squeeze(0))
    out_ref = torch.cat(outs)
    out_ref.pow(2).sum().backward()

    stats: dict = {}
    compare("output", out.squeeze(0), out_ref[start:stop], stats)
    compare("input grad", x.grad, x_ref.grad[start:stop], stats)
    local = slice(pg.ep_rank * num_local, (pg.ep_rank + 1) * num_local)
    unused = ~routing.any(0)[local] if capacity != "pad" else torch.zeros(num_local, dtype=torch.bool, device=dev)
    for name, p in model.named_parameters():
        ref_grad = dict(ref.named_parameters())[name].grad
        assert p.grad is not None, f"{name}: no gradient"
        if is_expert_name(name):
            grad = all_reduce_sum(p.grad, pg.expt_dp)
            compare(f"grad {name}", grad, ref_grad[local], stats)
            assert torch.equal(grad[unused], torch.zeros_like(grad[unused])), f"{name}: unused expert grad != 0"
        else:
            compare(f"grad {name}", all_reduce_sum(p.grad), ref_grad, stats)
    stats["unused_local_experts"] = int(unused.sum())
    # The overlapped path runs on CUDA only and eagerly (gloo and a compiled layer run the shared expert in order).
    assert len(side_stream_calls) == (1 if overlap and dev.type == "cuda" and not compiled else 0)
    return stats


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_moe_layer_matches_single_process(world, dispatcher, scenario):
    stats = run_distributed(world, _layer, scenario=scenario, dispatcher=dispatcher, capacity=None)
    print(f"world={world} {dispatcher} {scenario}: {stats[0]}")


def test_moe_layer_sync_free():
    """moe_dispatch_sync_free with biases and a shared expert: the unused rows past tokens_per_expert's sum (their
    values unspecified) leave the output and every gradient as the single-process layer's."""
    stats = run_distributed(2, _layer, scenario="dirichlet", dispatcher="alltoall", capacity=None, sync_free=True)
    print(f"world=2 alltoall dirichlet sync-free: {stats[0]}")


def test_sync_free_alltoall_layer_compiles_whole():
    """The sync-free all-to-all exchange traces: torch.compile(fullgraph=True) of the layer (its all-to-alls
    functional collectives, no graph break; with moe_shared_expert_overlap, the shared expert in order) equals the
    single-process layer, gradients included."""
    stats = run_distributed(2, _layer, timeout=300, scenario="dirichlet", dispatcher="alltoall", capacity=None,
                            sync_free=True, compiled=True, overlap=True)
    print(f"world=2 alltoall dirichlet sync-free compiled: {stats[0]}")
    # Negative control: the exchange with a host sync stays eager, a graph break that fullgraph refuses.
    with pytest.raises(RankFailure, match="Skip inlining"):
        run_distributed(2, _layer, timeout=300, scenario="dirichlet", dispatcher="alltoall", capacity=None,
                        compiled=True)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("capacity", ["drop", "pad"])
def test_moe_layer_with_capacity(dispatcher, capacity):
    stats = run_distributed(4, _layer, scenario="dirichlet", dispatcher=dispatcher, capacity=capacity)
    print(f"world=4 {dispatcher} dirichlet {capacity}: {stats[0]}")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("scenario", ["dirichlet", "send_zero"])
def test_moe_layer_with_shared_expert_overlap(dispatcher, scenario):
    """moe_shared_expert_overlap: on NCCL the shared expert runs on a side stream during the dispatch, forward
    and backward; the layer still equals the single-process one."""
    stats = run_distributed(2, _layer, scenario=scenario, dispatcher=dispatcher, capacity=None, overlap=True)
    print(f"world=2 {dispatcher} {scenario} overlap: {stats[0]}")


def _uneven_tokens(dispatcher: str, layout: str, tokens: list[int]) -> str:
    """A layer whose EP ranks pass ``tokens[rank]`` tokens, forward and backward; the error this rank raised, or
    "ok"."""
    rank, dev = dist.get_rank(), device()
    pg = groups(dist.get_world_size(), NUM_EXPERTS)
    kw = {"sync_free": dict(moe_dispatch_sync_free=True), "pad": CAPACITY["pad"], "dynamic": {}}[layout]
    torch.manual_seed(0)
    layer = MoELayer(layer_config(2, dispatcher, ep=pg.ep_size, **kw), pg).to(dev)
    x = torch.randn(tokens[rank], 16, device=dev, requires_grad=True)
    try:
        layer(x).square().sum().backward()
    except ValueError as e:
        return str(e)
    assert x.grad.shape == x.shape
    return "ok"


@pytest.mark.parametrize("dispatcher,layout", [("alltoall", "sync_free"), ("alltoall", "pad"), ("allgather", "pad")])
@pytest.mark.parametrize("tokens", [[8, 6], [0, 8]], ids=["8-6", "0-8"])
def test_static_layouts_refuse_different_token_counts_on_every_rank(dispatcher, layout, tokens):
    """Layouts with static split sizes need one T on every EP rank: a rank passing another T makes every rank raise a
    ValueError naming each rank's count (not an abort on one rank and a hang on the other). The dynamic layouts
    take the same counts (the control)."""
    errors = run_distributed(2, _uneven_tokens, dispatcher=dispatcher, layout=layout, tokens=tokens)
    for error in errors:
        assert f"same number of tokens on every EP rank, got {tokens}" in error, errors
    assert run_distributed(2, _uneven_tokens, dispatcher=dispatcher, layout="dynamic", tokens=tokens) == ["ok"] * 2


def _nan_token(dispatcher: str, sync_free: bool) -> bool:
    """One NaN token among this rank's: its output stays non-finite, every other token's equals the single-process
    layer's (whose NaN token is non-finite too)."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    pg = groups(world, NUM_EXPERTS)
    # No shared expert: its NaN would hide a routed part turned to zero.
    config = dataclasses.replace(layer_config(2, dispatcher), moe_shared_expert_intermediate_size=None)
    torch.manual_seed(0)
    ref = MoELayer(config).to(dev)
    model = MoELayer(dataclasses.replace(config, expert_model_parallel_size=world,
                                         moe_dispatch_sync_free=sync_free), pg).to(dev)
    model.load_state_dict(ep_state(ref.state_dict(), pg.ep_rank, model.num_local_experts))
    per_rank = GLOBAL_TOKENS // world
    x_all = torch.randn(GLOBAL_TOKENS, 16, generator=torch.Generator().manual_seed(5)).to(dev)
    nan_rows = torch.arange(world) * per_rank + 3  # the fourth token of every rank
    x_all[nan_rows, 5] = float("nan")
    with torch.no_grad():
        out = model(x_all[rank * per_rank:(rank + 1) * per_rank])
        out_ref = ref(x_all)[rank * per_rank:(rank + 1) * per_rank]
    finite = torch.ones(per_rank, dtype=torch.bool, device=dev)
    finite[3] = False
    assert not out[3].isfinite().any(), f"rank {rank}: the NaN token's output became {out[3]}"
    assert not out_ref[3].isfinite().any()
    compare("finite tokens", out[finite], out_ref[finite], {})
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dispatcher,sync_free", [("alltoall", False), ("alltoall", True), ("allgather", False)])
def test_nan_token_stays_nan(world, dispatcher, sync_free):
    """A NaN in a token's hidden state stays visible in its output under EP, as in one process: the dispatcher must
    not read a NaN prob as "not routed" and return an exact zero (the negative control is the single-process
    layer's NaN)."""
    assert all(run_distributed(world, _nan_token, dispatcher=dispatcher, sync_free=sync_free))
