"""Global gradient norm across dense (DP mesh) and expert (expert-DP mesh) parameters equals the
single-process norm for p = 1, 2, inf, under DDP and FSDP2 and every DP x EP layout."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_core.parallel.fsdp import split_expert_params
from moe_core.parallel.grad_clip import clip_grad_norm_, get_grad_norm
from moe_core.parallel.loss import global_token_count, token_mean_loss
from tests.parallel._common import compare, groups
from tests.parallel._launch import device, run_distributed
from tests.parallel._models import (
    SCENARIOS,
    ToyModel,
    forced_routing,
    load_ep_slice,
    make_config,
    per_token_loss,
    reference_state,
    token_counts,
    toy_parts,
)
from tests.parallel.test_training import WRAPPERS

GLOBAL_TOKENS = 24


def _norms(wrapper: str, ep: int) -> dict:
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    pg = groups(ep)
    sc = SCENARIOS["dirichlet"]
    full = reference_state(make_config())
    ref = ToyModel(make_config(), dispatcher=None).to(dev)
    ref.load_state_dict(full)
    cfg = make_config(ep=ep)
    model = ToyModel(cfg, pg, "alltoall", pg.ep_rank).to(dev)
    load_ep_slice(model, full, pg.ep_rank, cfg.num_local_experts)
    WRAPPERS[wrapper](model, pg, toy_parts(model))
    counts = token_counts(sc, GLOBAL_TOKENS, world)
    start, stop = sum(counts[:rank]), sum(counts[:rank + 1])
    routing = forced_routing(sc, GLOBAL_TOKENS, world, ep, 8).to(dev)
    x = torch.randn(GLOBAL_TOKENS, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(dev)
    num_global = global_token_count(counts[rank], pg.dp, dev)
    token_mean_loss(per_token_loss(model(x[start:stop], routing[start:stop])), num_global).backward()
    (per_token_loss(ref(x, routing)).sum() / GLOBAL_TOKENS).backward()
    dense, expert = split_expert_params(model, toy_parts(model).experts)
    assert dense and expert
    stats: dict = {}
    ref_grads = [p.grad for p in ref.parameters()]
    for p in (1.0, 2.0, float("inf")):
        norm = get_grad_norm(dense, expert, pg, norm_type=p)
        compare(f"{p}-norm", norm, torch.nn.utils.get_total_norm(ref_grads, norm_type=p), stats)
    # Without the expert parameters the norm must differ: the experts carry part of it.
    partial = get_grad_norm(dense, [], pg)
    assert float(partial) < float(torch.nn.utils.get_total_norm(ref_grads)) * (1 - 1e-3)
    # A wrong split raises, naming the misplaced parameter, before any gradient is scaled.
    before = [_local(p.grad).clone() for p in dense + expert]
    first_expert = f"dense_params[{len(dense)}] (shape {tuple(expert[0].shape)})"
    # DDP leaves experts alone on a one-rank expert-DP mesh unwrapped and the dense parameters under torch's DDP:
    # plain tensors both, marked allreduce=False and True.
    lone = wrapper == "ddp" and pg.expt_dp_mesh.size() == 1
    misplaced = r"an expert parameter \(allreduce=False" if lone else r"mesh \('expt_dp',\), expected \('dp',\)"
    with pytest.raises(ValueError, match=re.escape(first_expert) + r".*" + misplaced):
        clip_grad_norm_(dense + expert, [], 1e-3, pg)
    misplaced = r"a dense parameter \(allreduce=True" if lone else r"mesh \('dp',\), expected \('expt_dp',\)"
    with pytest.raises(ValueError, match=r"expert_params\[0\] .*" + misplaced):
        clip_grad_norm_([], dense + expert, 1e-3, pg)
    for b, p in zip(before, dense + expert, strict=True):
        assert torch.equal(b, _local(p.grad))
    return stats


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_grad_norm_matches_single_process(wrapper, world, ep):
    stats = run_distributed(world, _norms, wrapper=wrapper, ep=ep)
    print(f"{wrapper} world={world} ep={ep}: {stats[0]}")


def test_norm_type_checked():
    with pytest.raises(ValueError, match="norm_type: expected > 0 or inf, got 0.0"):
        get_grad_norm([], [], None, norm_type=0)
    assert float(get_grad_norm([], [], None)) == 0.0
