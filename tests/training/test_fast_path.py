"""The trainer's default path (``training.fast_path``): each None setting resolved to the fastest path that applies,
with a note naming why where it does not; settings the user gave stay."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.training.config import TrainingConfig
from moe_core.training.fast_path import resolve_fast_path

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def model(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=8, moe_router_topk=2,
                moe_ffn_hidden_size=8, expert_model_parallel_size=2)
    return TransformerConfig(**{**base, **kw})


def groups(tp: int = 1, expt_dp: int = 1) -> SimpleNamespace:
    """What resolve_fast_path reads of a ProcessGroupCollection."""
    return SimpleNamespace(tp=None if tp == 1 else object(), tp_size=tp,
                           expt_dp_mesh=SimpleNamespace(size=lambda: expt_dp))


def resolve(model_config, training=None, pg=None, device=CUDA):
    return resolve_fast_path(model_config, training or TrainingConfig(compile=True), pg or groups(), device)


def test_ep_on_cuda_takes_sync_free_graphs_and_overlap():
    m, t, notes = resolve(model(moe_shared_expert_intermediate_size=8))
    assert (m.moe_dispatch_sync_free, t.enable_cuda_graph, m.moe_shared_expert_overlap) == (True, True, True)
    assert notes == []


@pytest.mark.parametrize("kw,training,pg,why", [
    (dict(moe_token_dispatcher_type="allgather"), {}, groups(), "moe_dispatch_sync_free off: the allgather"),
    (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), {}, groups(),
     "moe_dispatch_sync_free off: drop_and_pad"),
    ({}, dict(use_torch_fsdp2=True), groups(), "enable_cuda_graph off: use_torch_fsdp2"),
    ({}, {}, groups(expt_dp=2), "enable_cuda_graph off: DDP keeps parameters in place only"),
    (dict(moe_dispatch_sync_free=False), {}, groups(), "enable_cuda_graph off: the EP dispatch is not sync-free"),
    (dict(moe_expert_capacity_factor=1.0), {}, groups(), "enable_cuda_graph off: a capacity factor"),
    (dict(recompute_granularity="selective"), {}, groups(), "enable_cuda_graph off: activation recompute"),
])
def test_a_path_that_cannot_apply_falls_back_with_a_note(kw, training, pg, why):
    _, t, notes = resolve(model(**kw), TrainingConfig(compile=True, **training), pg)
    assert any(note.startswith(why) for note in notes), notes
    if why.startswith("enable_cuda_graph"):
        assert t.enable_cuda_graph is False


def test_the_users_settings_stay():
    m, t, notes = resolve(model(moe_dispatch_sync_free=False), TrainingConfig(compile=True, enable_cuda_graph=False))
    assert (m.moe_dispatch_sync_free, t.enable_cuda_graph) == (False, False)
    m, _, _ = resolve(model(moe_dispatch_sync_free=True), device=CPU)
    assert m.moe_dispatch_sync_free is True


@pytest.mark.parametrize("device,training", [(CPU, TrainingConfig(compile=True)), (CUDA, TrainingConfig())],
                         ids=["cpu", "eager"])
def test_nothing_to_gain_resolves_off_without_notes(device, training):
    """On the CPU a host sync costs nothing and there are no graphs; eager layers have no graphs to replay."""
    m, t, notes = resolve(model(moe_shared_expert_intermediate_size=8), training, device=device)
    assert t.enable_cuda_graph is False and notes == []
    assert m.moe_dispatch_sync_free is (device.type == "cuda")
    assert m.moe_shared_expert_overlap is (device.type == "cuda")


def test_one_process():
    m, t, notes = resolve_fast_path(model(expert_model_parallel_size=1), TrainingConfig(compile=True), None, CUDA)
    assert (m.moe_dispatch_sync_free, t.enable_cuda_graph, notes) == (False, True, [])


def test_resolved_configs_are_new_objects():
    m, t = model(), TrainingConfig(compile=True)
    m2, t2, _ = resolve(m, t)
    assert m.moe_dispatch_sync_free is None and t.enable_cuda_graph is None
    assert dataclasses.replace(m2, moe_dispatch_sync_free=None, moe_shared_expert_overlap=None) == m
