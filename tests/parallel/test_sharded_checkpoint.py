"""Sharded checkpoints: saved without any rank gathering a tensor, loaded in another layout on gloo.

Each case trains one step in a layout (TP / ETP / EP / FSDP2 or replicate), saves, and loads into a fresh
model of another layout: EP 2 -> 1, FSDP 2 -> 4, TP 2 -> 1 (also into one process). Every parameter and AdamW
moment, gathered into the single-process tensor for the comparison only, must come back bitwise, and the step
with it. During the save, ``DTensor.full_tensor`` / ``redistribute`` and ``all_gather_into_tensor`` raise: the
save writes each rank's shards where they are. A NaN in one rank's shard stops a save, and a load of a checkpoint
holding one, on every rank with the same error.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_core.models.param_roles import param_roles
from moe_core.training import checkpoint
from moe_core.training.checkpoint import load_checkpoint, save_checkpoint
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training, train_step
from tests.parallel._common import groups
from tests.parallel._launch import run_distributed
from tests.parallel.test_tensor_parallel import NUM_EXPERTS, SEQ, VOCAB, _full, tp_config

TRAINING = TrainingConfig(micro_batch_size=1, global_batch_size=4, lr=1e-2, train_iters=10, lr_warmup_iters=1, seed=3)


def _refuse(*_args, **_kwargs):
    raise AssertionError("save_checkpoint gathered a tensor")


def _state(state, pg) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW moment as its single-process tensor, by single-process name (test only)."""
    model, optimizer = state.model, state.optimizer
    ep = 1 if pg is None else pg.ep_size
    roles = param_roles(model, 0 if ep == 1 else pg.local_expert_indices(NUM_EXPERTS)[0])
    out = {}
    for name, param in model.named_parameters():
        stacked = roles[name].stacked and ep > 1
        key = roles[name].name
        tensors = {"param": param, **{m: optimizer.state[param][m] for m in ("exp_avg", "exp_avg_sq")}}
        for what, t in tensors.items():
            out[f"{what} {key}"] = (t.detach() if pg is None else _full(t, stacked, pg)).cpu()
    return out


def _layout(tp: int, ep: int, etp: int, fsdp2: bool, grouped: bool):
    cfg = tp_config(tp, ep, etp, gate=True, moe_grouped_gemm=grouped)
    return cfg, dataclasses.replace(TRAINING, use_torch_fsdp2=fsdp2)


def _train_and_save(directory: str, tp: int, ep: int, etp: int, fsdp2: bool, grouped: bool) -> dict:
    pg = groups(ep, NUM_EXPERTS, tp, etp)
    cfg, training = _layout(tp, ep, etp, fsdp2, grouped)
    state = setup_training(cfg, training, pg)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
    rows = tokens.chunk(pg.dp_size)[pg.dp_rank]
    train_step(state, rows[:, :-1], rows[:, 1:])
    with mock.patch.object(DTensor, "full_tensor", _refuse), mock.patch.object(DTensor, "redistribute", _refuse), \
            mock.patch.object(dist, "all_gather_into_tensor", _refuse):
        save_checkpoint(directory, state.model, state.optimizer, state.scheduler, 1, pg, seed=training.seed,
                        model_config=cfg)
    return _state(state, pg)


def _load(directory: str, tp: int, ep: int, etp: int, fsdp2: bool, grouped: bool) -> dict:
    pg = groups(ep, NUM_EXPERTS, tp, etp) if dist.is_initialized() else None
    cfg, training = _layout(tp, ep, etp, fsdp2, grouped)
    state = setup_training(cfg, training, pg)
    step = load_checkpoint(directory, state.model, state.optimizer, state.scheduler, pg, seed=training.seed,
                           model_config=cfg)
    assert step == 1 and state.scheduler.last_epoch == 1
    return _state(state, pg)


def _merge(states: list[dict]) -> dict:
    """The ranks' tensors by name (a SequentialMLP expert lives on its EP rank only); copies must agree."""
    merged: dict = {}
    for state in states:
        for key, value in state.items():
            assert key not in merged or torch.equal(merged[key], value), f"ranks disagree on {key}"
            merged[key] = value
    return merged


@pytest.mark.parametrize("save,load", [
    # TP 2 -> 1 (and ETP 2 -> 1): gated fc1 halves, vocabulary and heads split by TP, FSDP2 over 1 DP rank.
    ((2, dict(tp=2, ep=1, etp=2, fsdp2=True, grouped=True)), (1, dict(tp=1, ep=1, etp=1, fsdp2=False, grouped=True))),
    # EP 2 -> 1 and FSDP 2 -> 4, SequentialMLP experts renamed by global index.
    ((2, dict(tp=1, ep=2, etp=1, fsdp2=True, grouped=False)), (4, dict(tp=1, ep=1, etp=1, fsdp2=True, grouped=False))),
    # TP 2 x EP 2 (ETP 1) under replicate -> EP 2 under FSDP2.
    ((4, dict(tp=2, ep=2, etp=1, fsdp2=False, grouped=True)), (2, dict(tp=1, ep=2, etp=1, fsdp2=True, grouped=True))),
])
def test_checkpoint_loads_in_another_layout(tmp_path, save, load):
    (save_world, save_layout), (load_world, load_layout) = save, load
    saved = _merge(run_distributed(save_world, _train_and_save, timeout=120, directory=str(tmp_path),
                                   **save_layout))
    if load_world == 1:
        loaded = [_load(str(tmp_path), **load_layout)]
    else:
        loaded = run_distributed(load_world, _load, timeout=120, directory=str(tmp_path), **load_layout)
    assert _merge(loaded).keys() == saved.keys()
    for rank, state in enumerate(loaded):
        differ = [key for key, value in state.items() if not torch.equal(value, saved[key])]
        assert not differ, f"rank {rank}: {differ[:5]}"


def _non_finite_on_rank1(directory: str) -> list[str]:
    """EP 2: rank 1 puts a NaN into one of its experts. The errors of a save, then of a load of a checkpoint
    holding the NaN (saved with the check off)."""
    pg = groups(2, NUM_EXPERTS)
    cfg, training = _layout(1, 2, 1, True, True)
    state = setup_training(cfg, training, pg)
    if dist.get_rank() == 1:
        with torch.no_grad():
            weight = state.model.decoder.layers[1].mlp.experts.linear_fc2.weight
            (weight.to_local() if isinstance(weight, DTensor) else weight)[-1, 0, 0] = float("nan")
    save = (directory, state.model, state.optimizer, state.scheduler, 1, pg)
    errors = []
    with pytest.raises(RuntimeError) as raised:
        save_checkpoint(*save, seed=training.seed, model_config=cfg)
    errors.append(str(raised.value))
    with mock.patch.object(checkpoint, "_first_non_finite", return_value=None):
        save_checkpoint(*save, seed=training.seed, model_config=cfg)
    fresh = setup_training(cfg, training, pg)
    with pytest.raises(ValueError) as raised:
        load_checkpoint(directory, fresh.model, fresh.optimizer, fresh.scheduler, pg, seed=training.seed,
                        model_config=cfg)
    errors.append(str(raised.value))
    return errors


def test_a_nan_in_one_ranks_shard_stops_every_rank(tmp_path):
    ranks = run_distributed(2, _non_finite_on_rank1, timeout=120, directory=str(tmp_path))
    key = "model.decoder.layers.1.mlp.experts.linear_fc2.weight"
    assert ranks[0] == ranks[1] == [
        f"save_checkpoint: refusing to save step 1: {key} holds NaN or Inf (the previous checkpoint stays the latest)",
        f"load: {key} in {tmp_path / 'step_1'} holds NaN or Inf (save_checkpoint never writes one: the files were "
        "written by another tool or changed with their manifest); load another checkpoint",
    ]
