"""moe_core's MoELayer (TopKRouter + dispatcher + GroupedMLP + shared expert) under EP equals the
single-process MoELayer: output, input gradient and every parameter gradient, for both dispatchers, every
forced routing, biases on, and with token dropping / drop_and_pad."""

from __future__ import annotations

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
    if dispatcher == "allgather" and SCENARIOS[scenario].empty_rank is not None:
        pytest.skip("AllGather needs the same token count on every EP rank")
    stats = run_distributed(world, _layer, scenario=scenario, dispatcher=dispatcher, capacity=None)
    print(f"world={world} {dispatcher} {scenario}: {stats[0]}")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_layer_sync_free(dispatcher):
    """moe_dispatch_sync_free with biases and a shared expert: the unused rows past tokens_per_expert's sum (their
    values unspecified) leave the output and every gradient as the single-process layer's."""
    stats = run_distributed(2, _layer, scenario="dirichlet", dispatcher=dispatcher, capacity=None, sync_free=True)
    print(f"world=2 {dispatcher} dirichlet sync-free: {stats[0]}")


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
    if dispatcher == "allgather" and SCENARIOS[scenario].empty_rank is not None:
        pytest.skip("AllGather needs the same token count on every EP rank")
    stats = run_distributed(2, _layer, scenario=scenario, dispatcher=dispatcher, capacity=None, overlap=True)
    print(f"world=2 {dispatcher} {scenario} overlap: {stats[0]}")
