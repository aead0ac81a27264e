"""moe_core's GPTModel trained with EP under DDP / FSDP2 equals single-process training.

Real TopKRouter, GroupedMLP, shared expert, attention and tied-free embeddings; two micro-batches, the
global token-mean loss, global-norm clipping (active), two AdamW steps. Routings: the learned router, and
"all tokens to EP rank 0's experts" (the Megatron report: the other EP ranks get zero tokens every step).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.models.param_roles import expert_modules, model_parts
from moe_core.moe.moe_layer import MoELayer
from moe_core.parallel.ddp import apply_ddp
from moe_core.parallel.fsdp import apply_fsdp2, split_expert_params
from moe_core.parallel.grad_clip import clip_grad_norm_
from moe_core.parallel.launch import rank_slice
from moe_core.parallel.loss import global_token_count, reduce_loss_for_logging, token_mean_loss
from tests.parallel._common import compare, groups
from tests.parallel._launch import device, run_distributed
from tests.parallel._models import forced_probs, is_expert_name
from tests.parallel.test_moe_layer_ep import ep_state
from tests.parallel.test_training import WRAPPERS, _gather

NUM_EXPERTS = 8
BATCH_PER_RANK = 2
MAX_NORM = 0.1


def gpt_config(dispatcher: str, ep: int = 1, **kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=16, vocab_size=32, seq_length=8,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=8,
        moe_layer_freq=[0, 1], moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep, **kw,
    )


def _route_to_first_experts(model) -> None:
    """Every token to experts 0 and 1 (EP rank 0's): the other EP ranks receive nothing."""
    for layer in model.moe_layers():
        def topk(logits):
            routing_map = torch.zeros_like(logits, dtype=torch.bool)
            routing_map[:, :2] = True
            return forced_probs(logits, routing_map), routing_map
        layer.router._topk_routing = topk


def _uneven_rows(global_batch: int, pg) -> slice:
    """The last DP rank gets no sequences, the others share the global batch (as evenly as it splits)."""
    if pg.dp_rank == pg.dp_size - 1:
        return slice(global_batch, global_batch)
    counts = [len(part) for part in torch.arange(global_batch).tensor_split(pg.dp_size - 1)]
    start = sum(counts[:pg.dp_rank])
    return slice(start, start + counts[pg.dp_rank])


def _gpt_train(wrapper: str, ep: int, dispatcher: str, routing: str, steps: int = 2, micro_batches: int = 2,
               empty_rank: bool = False, recompute: dict | None = None):
    world, dev = dist.get_world_size(), device()
    pg = groups(ep, NUM_EXPERTS)
    torch.manual_seed(0)
    ref = GPTModel(gpt_config(dispatcher)).to(dev)
    model = GPTModel(gpt_config(dispatcher, ep, **(recompute or {})), pg).to(dev)
    model.load_state_dict(ep_state(ref.state_dict(), pg.ep_rank, NUM_EXPERTS // ep))
    if routing == "ep_rank0_only":
        _route_to_first_experts(ref)
        _route_to_first_experts(model)
    WRAPPERS[wrapper](model, pg, model_parts(model))
    dense, expert = split_expert_params(model, expert_modules(model))
    opt = torch.optim.AdamW([{"params": dense}, {"params": expert}], lr=1e-2, foreach=True)  # as in test_training
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    global_batch = BATCH_PER_RANK * world
    rows = _uneven_rows(global_batch, pg) if empty_rank else rank_slice(global_batch, pg)
    stats: dict = {}
    for step in range(steps):
        num_global = global_token_count((rows.stop - rows.start) * 8 * micro_batches, pg.dp, dev)
        for mb in range(micro_batches):
            if wrapper == "ddp":  # one reduction per step, as train_step defers it
                model.set_requires_gradient_sync(mb == micro_batches - 1)
            g = torch.Generator().manual_seed(1000 * step + mb)
            tokens = torch.randint(0, 32, (global_batch, 9), generator=g).to(dev)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            loss = token_mean_loss(model(inputs[rows], labels[rows]), num_global)
            loss.backward()
            ref_loss = ref(inputs, labels).sum() / (global_batch * 8 * micro_batches)
            ref_loss.backward()
            compare(f"step {step} loss", reduce_loss_for_logging(loss, pg.dp), ref_loss, stats)
        grads, missing = _gather(model, pg, grads=True)
        assert not missing, f"parameters without a gradient: {missing}"
        for name, p in ref.named_parameters():
            compare(f"step {step} grad {name}", grads[name], p.grad, stats)
        norm = clip_grad_norm_(dense, expert, MAX_NORM, pg)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert float(ref_norm) > MAX_NORM
        compare(f"step {step} grad norm", norm, ref_norm, stats)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # AdamW divides by sqrt(v): fp32 rounding in tiny gradients grows, hence looser parameter tolerances.
    params, _ = _gather(model, pg, grads=False)
    param_stats: dict = {}
    for name, p in ref.named_parameters():
        compare(f"param {name}", params[name], p, param_stats, rtol=1e-4, atol=1e-5)
    stats["params_after_adamw"] = param_stats
    replicated = {}
    if wrapper == "ddp":
        replicated = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
                      for n, p in model.named_parameters() if not is_expert_name(n)}
    return {"stats": stats, "replicated": replicated}


@pytest.mark.parametrize("wrapper,world,ep,dispatcher,routing", [
    ("ddp", 2, 2, "alltoall", "router"),
    ("ddp", 2, 2, "alltoall", "ep_rank0_only"),
    ("fsdp2", 2, 2, "alltoall", "ep_rank0_only"),
    ("fsdp2", 4, 2, "alltoall", "router"),
    ("ddp", 4, 4, "allgather", "ep_rank0_only"),
])
def test_gpt_training_matches_single_process(wrapper, world, ep, dispatcher, routing):
    steps = 3 if routing == "ep_rank0_only" else 2  # the Megatron scenario: several steps, no hang
    results = run_distributed(world, _gpt_train, wrapper=wrapper, ep=ep, dispatcher=dispatcher, routing=routing,
                              steps=steps)
    print(f"{wrapper} world={world} ep={ep} {dispatcher} {routing}: {results[0]['stats']}")
    for name, value in results[0]["replicated"].items():
        for r in range(1, world):
            assert torch.equal(results[r]["replicated"][name], value), f"{name} differs on rank {r}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_gpt_training_with_an_empty_micro_batch_rank(world, dispatcher):
    """A DP rank whose micro-batches hold no sequences (input_ids [0, S]) at EP = world: attention, router, dispatch,
    experts and the loss run on zero tokens, and training equals the single-process run on the whole batch."""
    results = run_distributed(world, _gpt_train, wrapper="ddp", ep=world, dispatcher=dispatcher, routing="router",
                              empty_rank=True)
    print(f"ddp world={world} ep={world} {dispatcher} empty rank: {results[0]['stats']}")


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective", recompute_modules=["moe", "layernorm", "core_attn"]),
], ids=["full", "selective-moe"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_gpt_training_with_recompute_matches_single_process(recompute, wrapper):
    """Activation recompute under EP = 2: the recomputed MoE layer issues its all-to-alls again in backward on every
    rank, and training equals the single-process run without recompute."""
    results = run_distributed(2, _gpt_train, wrapper=wrapper, ep=2, dispatcher="alltoall", routing="router",
                              recompute=recompute)
    print(f"{wrapper} world=2 ep=2 recompute {recompute}: {results[0]['stats']}")


def _router_loads(sequences_per_rank: list[int], forwards: int, wrap: str) -> list[float]:
    pg = groups(2, NUM_EXPERTS)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPTModel(gpt_config("alltoall", 2), pg).to(device())
    if wrap == "ddp":
        apply_ddp(model, pg, model_parts(model))
    else:  # torch's DDP as a wrapper, buffers broadcast from rank 0 before every forward (its default)
        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=True)
    g = torch.Generator().manual_seed(rank)
    for _ in range(forwards):
        tokens = torch.randint(0, 32, (sequences_per_rank[rank], 9), generator=g).to(device())
        model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
    layers = (model if wrap == "ddp" else model.module).moe_layers()
    return [float(layer.router.local_tokens_per_expert.sum()) for layer in layers]


def test_router_loads_stay_each_ranks_own_under_ddp():
    """A router's loads (``local_tokens_per_expert``, a buffer each rank accumulates over its own tokens until the
    expert-bias update sums them) must survive DDP's forwards. Ranks 0 and 1 run 1 and 2 sequences of 8 tokens,
    top-2, twice. Negative control: torch's DDP wrapper with its default buffer broadcast hands rank 1 rank 0's
    count before each forward."""
    loads = run_distributed(2, _router_loads, sequences_per_rank=[1, 2], forwards=2, wrap="ddp")
    assert loads == [[2 * 1 * 8 * 2], [2 * 2 * 8 * 2]], loads
    broadcast = run_distributed(2, _router_loads, sequences_per_rank=[1, 2], forwards=2, wrap="broadcasting")
    assert broadcast[1] == [(1 + 2) * 8 * 2], broadcast  # rank 0's first count, then rank 1's second


def _masked_loss_under_fsdp2() -> dict:
    world, dev = dist.get_world_size(), device()
    pg = groups(2, NUM_EXPERTS)
    torch.manual_seed(0)
    ref = GPTModel(gpt_config("alltoall")).to(dev)
    model = GPTModel(gpt_config("alltoall", 2), pg).to(dev)
    model.load_state_dict(ep_state(ref.state_dict(), pg.ep_rank, NUM_EXPERTS // 2))
    apply_fsdp2(model, pg, model_parts(model))
    global_batch = BATCH_PER_RANK * world
    tokens = torch.randint(0, 32, (global_batch, 9), generator=torch.Generator().manual_seed(7)).to(dev)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(inputs[rank_slice(global_batch, pg)], labels[rank_slice(global_batch, pg)])
    views = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
    assert not views, views
    loss[:, :3] = 0  # in place on the module's output
    loss.sum().backward()
    mask = torch.ones(global_batch, 8, device=dev)
    mask[:, :3] = 0
    (ref(inputs, labels) * mask).sum().backward()
    grads, missing = _gather(model, pg, grads=True)
    assert not missing, f"parameters without a gradient: {missing}"
    stats: dict = {}
    for name, p in ref.named_parameters():
        compare(f"grad {name}", grads[name], p.grad, stats)
    return stats


def test_per_token_loss_masked_in_place_under_fsdp2():
    """GPTModel's per-token loss is its own tensor: FSDP2 does not warn about a returned view, and an in-place
    mask on it gives the gradient of the masked loss (world 2, EP 2, against one process)."""
    stats = run_distributed(2, _masked_loss_under_fsdp2)
    print(f"masked loss under FSDP2: {stats[0]}")


def _ep_size_mismatch() -> None:
    pg = groups(2, NUM_EXPERTS)
    for build in (GPTModel, MoELayer):
        with pytest.raises(ValueError, match=r"EP size 2 .* expert_model_parallel_size \(1\)"):
            build(gpt_config("alltoall", 1), pg)
        with pytest.raises(ValueError, match=r"EP size 1 .* expert_model_parallel_size \(2\)"):
            build(gpt_config("alltoall", 2), None)


def test_ep_size_mismatch_raises_at_construction():
    run_distributed(2, _ep_size_mismatch)
