"""Clipping and AdamW across all meshes under TP + SP with EP (and ETP), DDP and FSDP2.

One global gradient norm over TP-split, TP-replicated, expert and dense parameters equals the single-process
norm for p = 1, 2 and inf; a parameter passed in the wrong list raises. AdamW's fused and foreach
implementations, which batch each group's DTensors (one mesh per group), give the single-tensor path's
parameters.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.tensor import DTensor

from moe_core.models.param_roles import expert_modules
from moe_core.parallel.fsdp import split_expert_params
from moe_core.parallel.grad_clip import clip_grad_norm_, get_grad_norm
from moe_core.parallel.launch import rank_slice
from moe_core.training.config import TrainingConfig
from moe_core.training.step import build_optimizer
from tests.parallel._common import compare
from tests.parallel._launch import run_distributed
from tests.parallel.test_tensor_parallel import batch, build_pair

IMPLEMENTATIONS = {"single-tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tp_placements(param: torch.Tensor) -> set[str]:
    """'split' and / or 'replicated': how the TP (or ETP) mesh dimension holds ``param``."""
    names = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else ()
    return {"replicated" if param.placements[i].is_replicate() else "split"
            for i, name in enumerate(names) if name in ("tp", "expt_tp")}


def _norms_and_adamw(tp: int, ep: int, etp: int, wrapper: str) -> dict:
    pg, ref, model = build_pair(tp, ep, etp, wrapper)
    inputs, labels, micro = batch(0, pg)
    rows = rank_slice(inputs.shape[0], pg)
    (model(inputs[rows], labels[rows]).sum() / labels.numel()).backward()
    for m in micro:
        (ref(inputs[m], labels[m]).sum() / labels.numel()).backward()
    dense, expert = split_expert_params(model, expert_modules(model))
    kinds = set().union(*(_tp_placements(p) for p in dense))
    assert kinds == {"split", "replicated"} and expert, (kinds, len(expert))
    stats: dict = {}
    ref_grads = [p.grad for p in ref.parameters()]
    for norm_type in (1.0, 2.0, float("inf")):
        compare(f"{norm_type}-norm", get_grad_norm(dense, expert, pg, norm_type),
                torch.nn.utils.get_total_norm(ref_grads, norm_type=norm_type), stats)
    expected = re.escape("expert_params[0]") + r".*mesh \('dp', 'tp'\), expected \('expt_dp',\)"
    with pytest.raises(ValueError, match=expected):
        clip_grad_norm_([], dense + expert, 1.0, pg)

    params = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
    after = {}
    for implementation, kwargs in IMPLEMENTATIONS.items():
        with torch.no_grad():
            for name, p in model.named_parameters():
                _local(p).copy_(params[name])
                _local(p.grad).copy_(grads[name])
        optimizer = build_optimizer(model, TrainingConfig(lr=1e-2), **kwargs)
        for _ in range(2):
            optimizer.step()
        after[implementation] = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    moved = max(float((after["single-tensor"][n] - params[n]).abs().max()) for n in params)
    assert moved > 1e-3, "the optimizer steps must change the parameters"
    for implementation in ("foreach", "fused"):
        for name, value in after[implementation].items():
            compare(f"{implementation} {name}", value, after["single-tensor"][name], stats, rtol=1e-6, atol=1e-7)
    return stats


@pytest.mark.parametrize("world,tp,ep,etp,wrapper", [
    (2, 2, 2, 1, "fsdp2"),
    (4, 2, 2, 2, "ddp"),
])
def test_norm_and_adamw_across_meshes(world, tp, ep, etp, wrapper):
    stats = run_distributed(world, _norms_and_adamw, timeout=120, tp=tp, ep=ep, etp=etp, wrapper=wrapper)
    print(f"world {world} TP {tp} EP {ep} ETP {etp} {wrapper}: {stats[0]}")
