"""EP training under DDP and FSDP2 equals single-process training, step for step.

Each run: ToyModel (2 blocks of RMSNorm + MoE + dense, forced routing), the global batch split over the ranks,
two micro-batches of gradient accumulation, token-mean loss over the global batch, global-norm clipping that
is active, SGD steps. After every step's backward the gathered full gradient of every parameter, the clipped
norm and, at the end, every parameter equal the single-process reference (fp32, rtol 1e-5). Scenarios
cover the transformers FSDP2 report (per-layer fully_shard, disjoint experts per rank, accumulation,
clipping) and the Megatron report (EP = 2, one rank receives zero tokens, several steps). The negative
control runs the same procedure on a naive MoE that skips experts without tokens and must fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_core.parallel.collectives import all_gather_first_dim
from moe_core.parallel.ddp import apply_ddp
from moe_core.parallel.fsdp import apply_fsdp2, split_expert_params
from moe_core.parallel.grad_clip import clip_grad_norm_
from moe_core.parallel.loss import global_token_count, reduce_loss_for_logging, token_mean_loss
from moe_core.parallel.state import full_tensor
from tests.parallel._common import compare, groups
from tests.parallel._launch import DeadlineExceeded, RankFailure, device, run_distributed
from tests.parallel._models import (
    SCENARIOS,
    ToyModel,
    forced_routing,
    is_expert_name,
    load_ep_slice,
    make_config,
    naive_state,
    per_token_loss,
    reference_state,
    token_counts,
    toy_parts,
)

GLOBAL_TOKENS = 24
NUM_EXPERTS = 8
MAX_NORM = 0.05
WRAPPERS = {"ddp": apply_ddp, "fsdp2": apply_fsdp2}


def _full(t: torch.Tensor | None, like: torch.Tensor, expert: bool, pg) -> torch.Tensor:
    """Full tensor of a (DTensor) parameter or grad; expert tensors gathered over EP to [E, ...]."""
    t = torch.zeros(like.shape, device=like.device) if t is None else t
    t = full_tensor(t)
    return all_gather_first_dim(t.detach().contiguous(), pg.ep) if expert else t.detach()


def _gather(model, pg, grads: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Name -> full tensor in the reference's naming, and the names whose grad is missing (None)."""
    out, missing = {}, []
    for name, p in model.named_parameters():
        if grads and p.grad is None:
            missing.append(name)
        out[name] = _full(p.grad if grads else p, p, is_expert_name(name) and ".linears." not in name, pg)
    linears = sorted(k for k in out if ".linears." in k)
    for prefix in sorted({k.split(".linears.")[0] for k in linears}):
        stacked = [out.pop(f"{prefix}.linears.{e}.weight").t() for e in range(NUM_EXPERTS)]
        out[f"{prefix}.weight"] = torch.stack(stacked)
    return out, missing


def _train(wrapper: str, ep: int, scenario: str, dispatcher: str = "alltoall", steps: int = 2,
           micro_batches: int = 2) -> dict:
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    pg = groups(ep, NUM_EXPERTS)
    sc = SCENARIOS[scenario]
    ref_cfg = make_config(NUM_EXPERTS, sc.topk)
    full = reference_state(ref_cfg)
    ref = ToyModel(ref_cfg, dispatcher=None).to(dev)
    ref.load_state_dict(full)
    if dispatcher == "naive":
        model = ToyModel(ref_cfg, None, "naive").to(dev)
        model.load_state_dict(naive_state(full))
    else:
        cfg = make_config(NUM_EXPERTS, sc.topk, ep=ep)
        model = ToyModel(cfg, pg, dispatcher, pg.ep_rank).to(dev)
        load_ep_slice(model, full, pg.ep_rank, cfg.num_local_experts)
    WRAPPERS[wrapper](model, pg, toy_parts(model))
    dense, expert = split_expert_params(model, toy_parts(model).experts)
    if wrapper == "ddp":  # experts alone on their expert-DP mesh stay unwrapped, the dense ones under torch's DDP
        lone = pg.expt_dp_mesh.size() == 1
        assert all(isinstance(p, DTensor) != lone for p in expert + dense)
    # One group per mesh kind, as build_optimizer makes them: a foreach step (CUDA's default, forced here for
    # the CPU too) cannot mix DTensors with the plain experts DDP leaves alone on a one-rank expert-DP mesh.
    opt = torch.optim.SGD([{"params": dense}, {"params": expert}], lr=0.5, foreach=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    counts = token_counts(sc, GLOBAL_TOKENS, world)
    start, stop = sum(counts[:rank]), sum(counts[:rank + 1])
    routing = forced_routing(sc, GLOBAL_TOKENS, world, ep, NUM_EXPERTS).to(dev)
    stats: dict = {}
    for step in range(steps):
        num_global = global_token_count(counts[rank] * micro_batches, pg.dp, dev)
        assert int(num_global) == GLOBAL_TOKENS * micro_batches
        for mb in range(micro_batches):
            if wrapper == "ddp":  # one reduction per step, as train_step defers it
                model.set_requires_gradient_sync(mb == micro_batches - 1)
            x = torch.randn(GLOBAL_TOKENS, ref_cfg.hidden_size, generator=torch.Generator().manual_seed(
                100 * step + mb)).to(dev)
            loss = token_mean_loss(per_token_loss(model(x[start:stop], routing[start:stop])), num_global)
            loss.backward()
            out_ref = ref(x, routing)
            ref_loss = per_token_loss(out_ref).sum() / (GLOBAL_TOKENS * micro_batches)
            ref_loss.backward()
            compare("loss", reduce_loss_for_logging(loss, pg.dp), ref_loss, stats)
        grads, missing = _gather(model, pg, grads=True)
        assert not missing, f"parameters without a gradient: {missing}"
        for name, g in ref.named_parameters():
            compare(f"step {step} grad {name}", grads[name], g.grad, stats)
            if is_expert_name(name):  # experts no token reached: exactly 0 after the DP reduction too
                unused = g.grad.flatten(1).abs().sum(1) == 0
                assert torch.equal(grads[name][unused], torch.zeros_like(grads[name][unused])), name
                stats["unused_experts"] = max(stats.get("unused_experts", 0), int(unused.sum()))
        norm = clip_grad_norm_(dense, expert, MAX_NORM, pg)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert float(ref_norm) > MAX_NORM, "clipping must be active for the test to mean anything"
        compare(f"step {step} grad norm", norm, ref_norm, stats)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    params, _ = _gather(model, pg, grads=False)
    for name, p in ref.named_parameters():
        compare(f"param {name}", params[name], p, stats)
    replicated = {}
    if wrapper == "ddp":
        replicated = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
                      for n, p in model.named_parameters() if not is_expert_name(n)}
    return {"stats": stats, "replicated": replicated}


LAYOUTS = [(2, 1), (2, 2), (4, 2), (4, 4)]  # (world, ep); (4, 2) is DP x EP with expert-DP = 2


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("world,ep", LAYOUTS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_training_matches_single_process(wrapper, world, ep, scenario):
    steps = 3 if scenario == "recv_zero" else 2
    results = run_distributed(world, _train, wrapper=wrapper, ep=ep, scenario=scenario, steps=steps)
    print(f"{wrapper} world={world} ep={ep} {scenario}: {results[0]['stats']}")
    if wrapper == "ddp":
        for name, value in results[0]["replicated"].items():
            for r in range(1, world):
                assert torch.equal(results[r]["replicated"][name], value), f"{name} differs on rank {r}"


@pytest.mark.parametrize("world", [2, 4])
def test_allgather_dispatcher_trains_like_alltoall(world):
    results = run_distributed(world, _train, wrapper="fsdp2", ep=world, scenario="dirichlet",
                              dispatcher="allgather")
    print(f"allgather fsdp2 world={world}: {results[0]['stats']}")


def test_negative_control_naive_moe_fails_under_fsdp2():
    """The transformers-report MoE (skip experts without tokens) under the same FSDP2 test must fail.

    Proves the positive tests above can fail: wrong or missing gradients, a rank error, or a hang caught by
    the deadline all count.
    """
    with pytest.raises((RankFailure, DeadlineExceeded)) as info:
        run_distributed(2, _train, timeout=30, wrapper="fsdp2", ep=1, scenario="disjoint", dispatcher="naive",
                        steps=1)
    print(f"negative control failed as required: {type(info.value).__name__}: {str(info.value)[-400:]}")
