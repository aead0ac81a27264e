"""EP token dispatchers against a single-process dense reference, under every forced routing.

One MoE layer (router + dispatcher + experts), EP = world, fp32: the output, the input gradient, the router
gradient and every expert's weight gradient match the dense computation over all experts; experts that saw
no token have gradients exactly 0 (not None); AllGather and AlltoAll agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_core.moe.capacity import apply_token_dropping
from moe_core.moe.ep_counts import CountsCopy
from moe_core.ops.pack import packed_width
from tests.parallel._common import all_reduce_sum, compare, groups
from tests.parallel._launch import BACKEND, device, run_distributed
from tests.parallel._models import (
    CAPACITY,
    DISPATCHERS,
    GLOBAL_TOKENS,
    NUM_EXPERTS,
    SCENARIOS,
    ToyMoE,
    forced_probs,
    forced_routing,
    make_config,
    token_counts,
)


def _layer_parity(scenario: str, dispatchers: list[str], ep: int, capacity: str | None = None,
                  num_experts: int = NUM_EXPERTS, sync_free: bool = False) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    pg = groups(ep, num_experts)
    sc = SCENARIOS[scenario]
    cfg = make_config(num_experts, sc.topk, ep=ep, moe_dispatch_sync_free=sync_free, **CAPACITY[capacity])
    dev = device()
    torch.manual_seed(0)
    ref = ToyMoE(make_config(num_experts, sc.topk, **CAPACITY[capacity]), dispatcher=None).to(dev)
    x_all = torch.randn(GLOBAL_TOKENS, cfg.hidden_size, device=dev)
    routing_all = forced_routing(sc, GLOBAL_TOKENS, world, ep, num_experts).to(dev)
    counts = token_counts(sc, GLOBAL_TOKENS, world)
    start, stop = sum(counts[:rank]), sum(counts[:rank + 1])

    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref, routing_all, counts)
    (out_ref.pow(2).sum() / GLOBAL_TOKENS).backward()
    num_local = num_experts // ep
    local = slice(pg.ep_rank * num_local, (pg.ep_rank + 1) * num_local)
    unused = ~routing_all.any(0)  # [E] experts no token visits
    dropped = int((routing_all & ~ref.last_routing_map).sum())
    if capacity is not None:
        assert dropped > 0, "capacity factor 1 on this routing must drop tokens"
    if capacity == "pad":
        unused[:] = False  # padding rows reach every expert
    assert torch.equal(ref.experts.weight.grad[unused], torch.zeros_like(ref.experts.weight.grad[unused]))

    stats: dict = {"unused_experts": int(unused.sum()), "dropped_routes": dropped}
    results = {}
    for name in dispatchers:
        model = ToyMoE(cfg, pg, name, pg.ep_rank).to(dev)
        model.router.weight.data.copy_(ref.router.weight)
        model.experts.weight.data.copy_(ref.experts.weight[local])
        x = x_all[start:stop].clone().requires_grad_()
        out = model(x, routing_all[start:stop])
        (out.pow(2).sum() / GLOBAL_TOKENS).backward()
        expert_grad = all_reduce_sum(model.experts.weight.grad, pg.expt_dp)
        compare(f"{name} output", out, out_ref[start:stop], stats)
        compare(f"{name} input grad", x.grad, x_ref.grad[start:stop], stats)
        compare(f"{name} router grad", all_reduce_sum(model.router.weight.grad), ref.router.weight.grad, stats)
        compare(f"{name} expert grad", expert_grad, ref.experts.weight.grad[local], stats)
        zero = expert_grad[unused[local]]
        assert torch.equal(zero, torch.zeros_like(zero)), f"{name}: unused experts' grads are not exactly 0"
        results[name] = (out.detach(), x.grad, expert_grad)
    first, *others = results
    agree: dict = {"max_abs": 0.0}
    for other in others:
        for label, a, b in zip(("output", "input grad", "expert grad"), results[first], results[other], strict=True):
            compare(f"{other} vs {first} {label}", b, a, agree, rtol=1e-6, atol=1e-7)
    stats["agree_max_abs"] = agree["max_abs"]
    return stats


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_dispatchers_match_reference(world, scenario):
    # The alltoall dispatcher's two layouts (token rows, its default here, and expert rows) hand the experts the same
    # rows; so does the allgather dispatcher, an EP rank without tokens (send_zero) included.
    dispatchers = ["alltoall", "alltoall_expert_rows", "allgather"]
    stats = run_distributed(world, _layer_parity, scenario=scenario, dispatchers=dispatchers, ep=world)
    print(f"world={world} {scenario}: {stats[0]}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario,capacity", [("dirichlet", None), ("send_zero", None), ("one_expert", "pad")])
def test_one_local_expert(world, scenario, capacity):
    """E = EP (one expert per rank): rows arrive sorted, so they and the probs travel unpacked, unsorted."""
    stats = run_distributed(world, _layer_parity, scenario=scenario, dispatchers=["alltoall", "allgather"], ep=world,
                            capacity=capacity, num_experts=world)
    print(f"world={world} E={world} {scenario} {capacity}: {stats[0]}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", ["dirichlet", "recv_zero", "disjoint", "one_expert"])
def test_sync_free_dispatch_matches_reference(world, scenario):
    """moe_dispatch_sync_free: every token to every rank, expert rows sized for the worst case and padded past
    tokens_per_expert's sum; the same results as the reference (and unused experts' gradients exactly 0)."""
    stats = run_distributed(world, _layer_parity, scenario=scenario, dispatchers=["alltoall"], ep=world, sync_free=True)
    print(f"world={world} {scenario} sync-free: {stats[0]}")


@pytest.mark.parametrize("num_experts,capacity", [(2, None), (NUM_EXPERTS, "drop")])
def test_sync_free_dispatch_one_local_expert_and_capacity(num_experts, capacity):
    """E = EP sends token rows too when sync-free; with a capacity factor (no padding) the dropped routes shrink
    the rows under the same bound."""
    stats = run_distributed(2, _layer_parity, scenario="dirichlet", dispatchers=["alltoall"], ep=2, capacity=capacity,
                            num_experts=num_experts, sync_free=True)
    print(f"E={num_experts} sync-free {capacity}: {stats[0]}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("capacity", ["drop", "pad"])
@pytest.mark.parametrize("scenario", ["dirichlet", "recv_zero"])
def test_dispatchers_with_capacity(world, capacity, scenario):
    """Token dropping (capacity factor 1 under skewed routing drops tokens) and drop_and_pad (static shapes)."""
    stats = run_distributed(world, _layer_parity, scenario=scenario, dispatchers=["alltoall", "allgather"],
                            ep=world, capacity=capacity)
    print(f"world={world} {scenario} {capacity}: {stats[0]}")


TOKEN_CHECK = "all_gather_into_tensor(1,):torch.int64"  # ep_counts.TokenCountCheck's exchange of T


def _collective_trace(scenario: str, dispatcher: str, capacity: str | None = None,
                      num_experts: int = NUM_EXPERTS, sync_free: bool = False) -> tuple[list[str], int]:
    """The sequence of collectives one rank issues in a forward + backward of the layer, and how many times the
    dispatcher waited for exchanged counts on the host."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    pg = groups(world, num_experts)
    sc = SCENARIOS[scenario]
    trace: list[str] = []
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor")}
    original_wait = CountsCopy.wait
    waits = []

    def recorder(name):
        def call(out, inp, *args, **kwargs):
            trace.append(f"{name}{tuple(inp.shape[1:])}:{inp.dtype}")
            return originals[name](out, inp, *args, **kwargs)
        return call

    def counting_wait(self):
        waits.append(1)
        return original_wait(self)

    try:
        for name in originals:
            setattr(dist, name, recorder(name))
        CountsCopy.wait = counting_wait
        config = make_config(num_experts, sc.topk, ep=world, moe_dispatch_sync_free=sync_free, **CAPACITY[capacity])
        model = ToyMoE(config, pg, dispatcher, pg.ep_rank).to(dev)
        counts = token_counts(sc, GLOBAL_TOKENS, world)
        start, stop = sum(counts[:rank]), sum(counts[:rank + 1])
        routing = forced_routing(sc, GLOBAL_TOKENS, world, world, num_experts).to(dev)
        x = torch.randn(GLOBAL_TOKENS, 16, device=dev)[start:stop].requires_grad_()
        model(x, routing[start:stop]).pow(2).sum().backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        CountsCopy.wait = original_wait
    return trace, len(waits)


@pytest.mark.parametrize("dispatcher,scenarios,sync_free", [
    ("alltoall", ["recv_zero", "send_zero", "one_expert", "disjoint"], False),
    ("alltoall_expert_rows", ["recv_zero", "send_zero", "disjoint"], False),
    ("allgather", ["recv_zero", "send_zero", "one_expert", "disjoint"], False),
    ("alltoall", ["recv_zero", "one_expert", "disjoint"], True),
])
def test_same_collectives_on_every_rank(dispatcher, scenarios, sync_free):
    """Whatever the routing (a rank sending or receiving nothing included), every rank issues the same
    collectives in the same order, forward and backward, so none can wait on a peer that skipped one."""
    for scenario in scenarios:
        traces = [trace for trace, _ in run_distributed(4, _collective_trace, scenario=scenario,
                                                        dispatcher=dispatcher, sync_free=sync_free)]
        assert traces[0], "no collective recorded"
        for rank, trace in enumerate(traces):
            assert trace == traces[0], f"{scenario}: rank {rank} issued {trace}, rank 0 issued {traces[0]}"
        print(f"{dispatcher} {scenario}: {traces[0]}")


@pytest.mark.parametrize("capacity", [None, "pad"])
def test_alltoall_sends_probs_inside_the_rows_and_syncs_once(capacity):
    """Several local experts: one count exchange (with drop_and_pad, whose splits are static, the token-count
    check's all-gather instead), then one all-to-all of packed rows (hidden + tail: the probs, and without
    drop_and_pad the local experts) each way per dispatch and one per combine; the host waits for the counts once per
    dispatch. One local expert: rows and probs travel apart."""
    hidden, topk = 16, 2
    width = packed_width(hidden, 1 if capacity else 2 * topk, torch.float32)
    count, rows = "all_to_all_single():torch.int64", f"all_to_all_single{(hidden,)}:torch.float32"
    packed, probs = f"all_to_all_single{(width,)}:torch.float32", "all_to_all_single():torch.float32"
    head = [TOKEN_CHECK] if capacity else [count]
    for trace, waits in run_distributed(2, _collective_trace, scenario="dirichlet", dispatcher="alltoall",
                                        capacity=capacity):
        assert trace == head + [packed, rows, rows, packed]  # backward: combine's mirror, then dispatch's
        assert waits == 1
    for trace, waits in run_distributed(2, _collective_trace, scenario="balanced", dispatcher="alltoall",
                                        num_experts=2):
        assert sorted(trace) == sorted([count, rows, probs, rows, rows, rows, probs]) and waits == 1


@pytest.mark.parametrize("num_experts", [NUM_EXPERTS, 2])
def test_sync_free_alltoall_exchanges_only_the_token_count(num_experts):
    """Sync-free, eager: no count exchange, only the token-count check (one all-gather of T, one host wait); one
    all-to-all of packed rows each way per dispatch and per combine, one local expert included. (Compiled, the
    check is not traced: ``test_sync_free_alltoall_layer_compiles_whole``.)"""
    hidden, num_local = 16, num_experts // 2
    width = packed_width(hidden, num_local, torch.float32)
    packed, rows = f"all_to_all_single{(width,)}:torch.float32", f"all_to_all_single{(hidden,)}:torch.float32"
    for trace, waits in run_distributed(2, _collective_trace, scenario="dirichlet", dispatcher="alltoall",
                                        num_experts=num_experts, sync_free=True):
        assert trace == [TOKEN_CHECK, packed, rows, rows, packed] and waits == 1


def _bytes_sent(scenario: str, topk: int) -> int:
    """Rows this rank hands to the rows' all-to-all in one alltoall dispatch (self included)."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    pg = groups(world, NUM_EXPERTS)
    sc = SCENARIOS[scenario]
    model = ToyMoE(make_config(NUM_EXPERTS, topk, ep=world), pg, "alltoall", pg.ep_rank).to(dev)
    tokens = GLOBAL_TOKENS // world
    routing = forced_routing(sc, GLOBAL_TOKENS, world, world, NUM_EXPERTS)[rank * tokens:][:tokens].to(dev)
    _, _, _, meta = model.dispatcher.dispatch(torch.randn(tokens, 16, device=dev), torch.rand(routing.shape,
                                              device=dev) * routing, routing)
    return sum(meta.input_splits)


def test_alltoall_sends_each_token_once_per_rank():
    """Token rows: a token travels once to each rank holding any of its experts, however many it holds there.
    "balanced" routes token t to experts 2t, 2t+1 (mod 8), both on one of the 2 ranks: one row per token, where one
    row per expert would send two."""
    assert run_distributed(2, _bytes_sent, scenario="balanced", topk=2) == [GLOBAL_TOKENS // 2] * 2


def _sync_free_dispatch(capacity: str | None, name: str = "alltoall", sync_free: bool = False) -> bool:
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    pg = groups(world, NUM_EXPERTS)
    config = make_config(NUM_EXPERTS, 2, ep=world, moe_dispatch_sync_free=sync_free, **CAPACITY[capacity])
    num_local = NUM_EXPERTS // world
    dispatcher = DISPATCHERS[name](num_local, list(range(rank * num_local, (rank + 1) * num_local)), config, pg)
    tokens = GLOBAL_TOKENS // world
    routing = forced_routing(SCENARIOS["dirichlet"], GLOBAL_TOKENS, world, world, NUM_EXPERTS)[rank * tokens:][:tokens]
    probs = forced_probs(torch.randn(tokens, NUM_EXPERTS), routing)
    if capacity == "pad":
        probs, routing = apply_token_dropping(probs, routing, dispatcher.capacity(tokens), pad_to_capacity=True)
    hidden = torch.randn(tokens, 16, device=dev, requires_grad=True)
    probs, routing = probs.to(dev).requires_grad_(), routing.to(dev)

    def step():
        permuted, _, permuted_probs, meta = dispatcher.dispatch(hidden, probs, routing)
        dispatcher.combine(permuted * permuted_probs.unsqueeze(-1), meta).pow(2).sum().backward()

    step()  # the communicators' set-up may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return True


@pytest.mark.skipif(BACKEND != "nccl", reason="host syncs exist on CUDA only (MOE_CORE_TEST_BACKEND=nccl)")
@pytest.mark.parametrize("capacity", [None, "pad"])
def test_alltoall_has_no_implicit_host_sync(capacity):
    """Under torch.cuda.set_sync_debug_mode("error") (any synchronising CUDA call raises) the dispatcher's forward
    and backward run: its one wait for the counts is an event wait on a copy already queued."""
    assert all(run_distributed(2, _sync_free_dispatch, capacity=capacity))


@pytest.mark.skipif(BACKEND != "nccl", reason="host syncs exist on CUDA only (MOE_CORE_TEST_BACKEND=nccl)")
@pytest.mark.parametrize("name,sync_free", [("alltoall", True), ("allgather", False)])
def test_dispatch_has_no_implicit_host_sync(name, sync_free):
    """Under torch.cuda.set_sync_debug_mode("error"): the sync-free all-to-all's token-count check, and the allgather
    dispatcher's count exchange that sizes its padding and its permute, are event waits on copies already queued."""
    assert all(run_distributed(2, _sync_free_dispatch, capacity=None, name=name, sync_free=sync_free))


@pytest.mark.parametrize("name", ["alltoall", "allgather"])
def test_bad_inputs_raise(name):
    cfg = make_config(NUM_EXPERTS, 2)
    cls = DISPATCHERS[name]
    with pytest.raises(ValueError, match=r"local_expert_indices: expected \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        cls(NUM_EXPERTS, [1, 2, 3, 4, 5, 6, 7, 8], cfg)
    d = cls(NUM_EXPERTS, list(range(NUM_EXPERTS)), cfg)
    hidden, probs, routing_map = torch.zeros(4, 16), torch.zeros(4, NUM_EXPERTS), torch.zeros(4, NUM_EXPERTS).bool()
    with pytest.raises(ValueError, match=r"hidden: expected \[T, H\], got shape \(4, 2, 8\)"):
        d.dispatch(hidden.view(4, 2, 8), probs, routing_map)
    with pytest.raises(ValueError, match=r"expected shape \(4, 8\), got \(4, 7\)"):
        d.dispatch(hidden, probs[:, :7], routing_map)
    with pytest.raises(TypeError, match="routing_map: expected torch.bool, got torch.float32"):
        d.dispatch(hidden, probs, probs)
