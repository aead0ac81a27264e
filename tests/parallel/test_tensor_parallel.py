"""GPTModel trained under TP + SP (with EP, ETP 1 or TP, DDP or FSDP2) equals single-process training.

Each run: a 2-layer GPT (dense layer, then MoE with aux loss, sequence aux loss, z-loss, expert bias, QK-norm
and GQA) trained for three AdamW steps with global-norm clipping on a global batch split over the DP ranks,
each DP rank's sequences split over its TP ranks. The reference is one process with the same weights running
the DP ranks' micro-batches in turn (their aux losses are per micro-batch). Checked, against the reference:
the gradient of every parameter after an aux-loss-only backward (the router losses alone) and after each
step's backward (fp32: rtol 1e-5, atol 1e-4 of the tensor's largest entry; a missing reduction errs by
O(1)), the loss, the clipped global norm, and every parameter at the end. Checked
across ranks: every parameter replicated over TP (router weight, norms, shared-expert gate) and the expert
bias are bitwise equal on the ranks of each TP group after the steps.

The negative control is the torchtitan report's bug: the router's local (partial) gradient declared
``Replicate`` instead of ``Partial``, so nothing reduces it over TP. Its gradients must differ from the
reference and its router weights must drift apart across the TP ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

import moe_core.moe.router as router_module
from moe_core.config import TransformerConfig
from moe_core.models.full_state import load_full_state_dict
from moe_core.models.gpt import GPTModel
from moe_core.models.param_roles import expert_modules, model_parts, param_roles
from moe_core.models.tp_plan import apply_tensor_parallel, tp_placement
from moe_core.parallel.collectives import all_gather_first_dim
from moe_core.parallel.fsdp import split_expert_params
from moe_core.parallel.grad_clip import clip_grad_norm_
from moe_core.parallel.launch import rank_slice
from moe_core.parallel.loss import reduce_loss_for_logging
from moe_core.parallel.state import full_tensor
from moe_core.training.config import TrainingConfig
from moe_core.training.step import build_optimizer
from tests.parallel._common import compare, groups
from tests.parallel._launch import device, run_distributed
from tests.parallel.test_training import WRAPPERS

NUM_EXPERTS = 8
VOCAB = 32
SEQ = 8
BATCH_PER_DP = 2
STEPS = 3
MAX_NORM = 0.1


def tp_config(tp: int = 1, ep: int = 1, etp: int = 1, shared: bool = True, gate: bool = False,
              on_output: bool = False, **extra) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=16,
        vocab_size=VOCAB, seq_length=SEQ, qk_layernorm=True, num_moe_experts=NUM_EXPERTS, moe_router_topk=2,
        moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=8 if shared else None,
        moe_shared_expert_gate=gate, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.1],
        moe_z_loss_coeff=0.01, moe_apply_probs_on_output=on_output, tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, **extra,
    )


def _full(t: torch.Tensor, expert: bool, pg) -> torch.Tensor:
    """The single-process tensor: a DTensor's full tensor, an expert tensor gathered over EP."""
    t = full_tensor(t)
    return all_gather_first_dim(t.detach().contiguous(), pg.ep) if expert else t.detach()


def _replicated_over_tp(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
        return False
    return param.placements[param.device_mesh.mesh_dim_names.index("tp")].is_replicate()


def _router_grad_marked_replicate(weight: torch.Tensor) -> torch.Tensor:
    """NEGATIVE CONTROL (the torchtitan report): the partial local gradient declared Replicate, never reduced."""
    return weight.to_local(grad_placements=[Replicate()]) if isinstance(weight, DTensor) else weight


def build_pair(tp: int, ep: int, etp: int, wrapper: str, **config) -> tuple:
    """``(pg, reference GPTModel, the same weights split by TP / EP and wrapped)``; aux-loss scale 1 / DP."""
    pg = groups(ep, NUM_EXPERTS, tp, etp)
    cfg = tp_config(tp, ep, etp, **config)
    torch.manual_seed(0)
    ref = GPTModel(cfg.single_process()).to(device())
    model = GPTModel(cfg, pg).to(device())
    load_full_state_dict(model, ref.state_dict(), pg)
    apply_tensor_parallel(model, pg)
    roles = param_roles(model)
    misplaced = {name: p.placements for name, p in model.named_parameters()
                 if isinstance(p, DTensor) and p.placements != (tp_placement(roles[name]),)}
    assert not misplaced, f"placed otherwise than their roles say: {misplaced}"
    WRAPPERS[wrapper](model, pg, model_parts(model))
    for layer in model.moe_layers() + ref.moe_layers():
        layer.router.aux_loss_scale = 1.0 / pg.dp_size  # one micro-batch per DP rank
    return pg, ref, model


def batch(step: int, pg) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
    """The global batch of ``step`` (inputs, labels) and the rows of each DP rank."""
    dp = pg.dp_size
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH_PER_DP * dp, SEQ + 1), generator=generator).to(device())
    return tokens[:, :-1], tokens[:, 1:], [slice(d * BATCH_PER_DP, (d + 1) * BATCH_PER_DP) for d in range(dp)]


def _train(tp: int, ep: int, etp: int, wrapper: str, shared: bool = True, gate: bool = False,
           on_output: bool = False, control: bool = False) -> dict:
    dev = device()
    pg, ref, model = build_pair(tp, ep, etp, wrapper, shared=shared, gate=gate, on_output=on_output)
    dp = pg.dp_size
    train_cfg = TrainingConfig(lr=1e-2, micro_batch_size=BATCH_PER_DP)
    opt, ref_opt = build_optimizer(model, train_cfg), build_optimizer(ref, train_cfg)
    dense, expert = split_expert_params(model, expert_modules(model))
    experts = {name for name, role in param_roles(model).items() if role.expert}
    errors: list[str] = []
    stats: dict = {}

    def check(name, actual, expected, **tolerance):
        try:
            compare(name, actual, expected, stats, **tolerance)
        except AssertionError as e:
            errors.append(" ".join(str(e).split()))

    def check_grads(what: str) -> None:
        # fp32 sums in another order (TP partial sums) with cancellation: rtol 1e-5, atol 1e-4 of the largest entry.
        for name, p in model.named_parameters():
            grad, expected = torch.zeros_like(p) if p.grad is None else p.grad, ref.get_parameter(name).grad
            check(f"{what} grad {name}", _full(grad, name in experts, pg), expected,
                  atol=1e-4 * float(expected.abs().max()) + 1e-12)

    global_batch = BATCH_PER_DP * dp
    rows = rank_slice(global_batch, pg)
    saved_tp_full = router_module.tp_full
    if control:
        router_module.tp_full = _router_grad_marked_replicate
    try:
        for step in range(STEPS):
            inputs, labels, micro = batch(step, pg)
            if step == 0:  # the router losses alone: their gradients equal TP 1's
                (model(inputs[rows], labels[rows]).sum() * 0).backward()
                for m in micro:
                    (ref(inputs[m], labels[m]).sum() * 0).backward()
                check_grads("aux-only")
                opt.zero_grad()
                ref_opt.zero_grad()
                for layer in model.moe_layers() + ref.moe_layers():
                    layer.router.local_tokens_per_expert.zero_()
            num_tokens = global_batch * SEQ
            loss = model(inputs[rows], labels[rows]).sum() / num_tokens
            loss.backward()
            ref_loss = torch.zeros((), device=dev)
            for m in micro:
                micro_loss = ref(inputs[m], labels[m]).sum() / num_tokens
                micro_loss.backward()
                ref_loss += micro_loss.detach()
            check(f"step {step} loss", reduce_loss_for_logging(loss, pg.dp), ref_loss)
            check_grads(f"step {step}")
            norm = clip_grad_norm_(dense, expert, MAX_NORM, pg)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            assert float(ref_norm) > MAX_NORM
            check(f"step {step} grad norm", norm, ref_norm)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            for layer in model.moe_layers():
                dist.all_reduce(layer.router.local_tokens_per_expert, group=pg.tp_dp)
            for layer in model.moe_layers() + ref.moe_layers():
                layer.router.update_expert_bias()
    finally:
        router_module.tp_full = saved_tp_full
    for name, p in model.named_parameters():
        # AdamW divides by sqrt(v): fp32 rounding in tiny gradients grows, hence looser parameter tolerances.
        check(f"param {name}", _full(p, name in experts, pg), ref.get_parameter(name), rtol=1e-4, atol=1e-5)
    replicated = {name: p.to_local().detach().cpu().clone() for name, p in model.named_parameters()
                  if _replicated_over_tp(p)}
    replicated.update({f"{i}.expert_bias": layer.router.expert_bias.cpu().clone()
                       for i, layer in enumerate(model.moe_layers())})
    return {"errors": errors, "replicated": replicated, "stats": stats}


def _differing_replicas(results: list[dict], tp: int) -> list[str]:
    """Names of TP-replicated tensors that are not bitwise equal on the ranks of a TP group (ranks r * tp ...)."""
    differ = []
    for rank, result in enumerate(results):
        first = results[rank - rank % tp]["replicated"]
        differ += [f"rank {rank} {name}" for name, value in result["replicated"].items()
                   if not torch.equal(value, first[name])]
    return differ


@pytest.mark.parametrize("world,tp,ep,etp,wrapper,shared,gate,on_output", [
    (2, 2, 1, 1, "fsdp2", True, True, False),
    (2, 2, 2, 1, "ddp", False, False, True),
    (2, 2, 1, 2, "fsdp2", True, False, True),
    (4, 2, 2, 2, "fsdp2", True, True, False),
    (4, 2, 4, 1, "ddp", True, False, True),
])
def test_tp_training_matches_single_process(world, tp, ep, etp, wrapper, shared, gate, on_output):
    results = run_distributed(world, _train, timeout=120, tp=tp, ep=ep, etp=etp, wrapper=wrapper, shared=shared,
                              gate=gate, on_output=on_output)
    print(f"world {world} TP {tp} EP {ep} ETP {etp} {wrapper}: {results[0]['stats']}")
    for rank, result in enumerate(results):
        assert not result["errors"], f"rank {rank}: {result['errors'][:5]}"
    assert any("router.weight" in name for name in results[0]["replicated"])
    assert not _differing_replicas(results, tp)


def test_router_grad_marked_replicate_fails():
    """The negative control: without the Partial -> Replicate reduction the router gradients differ from the
    reference (also in the aux-loss-only backward) and the router weights drift apart across TP ranks."""
    results = run_distributed(2, _train, timeout=120, tp=2, ep=1, etp=1, wrapper="ddp", control=True)
    errors = results[0]["errors"]
    assert any(e.startswith("aux-only grad decoder.layers.1.mlp.router.weight") for e in errors), errors[:5]
    assert any(e.startswith("step 0 grad decoder.layers.1.mlp.router.weight") for e in errors), errors[:5]
    assert "rank 1 decoder.layers.1.mlp.router.weight" in _differing_replicas(results, 2)
