"""Checkpoints with torch.distributed.checkpoint (DCP) that load in any process layout.

The state is saved in the single-process layout: full tensors (``get_state_dict(full_state_dict=True)``
gathers FSDP2 shards and replicated DTensors) with every expert tensor gathered over expert parallelism
(``[E, ...]``, EP rank r's rows ``[r * L, (r + 1) * L)``). Every rank then holds identical tensors and DCP
writes each once; loading slices this rank's experts and lets ``set_state_dict`` re-shard. Gathering under
the same names matters: EP ranks hold *different* experts under the same parameter name, which DCP would
otherwise treat as one replicated tensor and keep only one rank's copy. Full tensors on every rank suit
the model sizes this trainer runs; without a process group DCP runs in its single-process mode.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from moe_core.parallel.collectives import all_gather_first_dim
from moe_core.parallel.state import expert_param_names

_OPTIONS = StateDictOptions(full_state_dict=True)


def _expert_tensors(model_sd: dict, optim_sd: dict, experts: set[str]):
    """``(dict, key)`` of every expert tensor: model weights and their optimizer moments (not ``step``)."""
    for name in sorted(experts):
        yield model_sd, name
        per_param = optim_sd["state"].get(name, {})
        for key in sorted(per_param):
            if isinstance(per_param[key], torch.Tensor) and per_param[key].dim() > 0:
                yield per_param, key


def _full_state(model, optimizer, pg_collection) -> tuple[dict, dict]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    if pg_collection is not None and pg_collection.ep_size > 1:
        for sd, key in _expert_tensors(model_sd, optim_sd, expert_param_names(model)):
            sd[key] = all_gather_first_dim(sd[key].contiguous(), pg_collection.ep)
    return model_sd, optim_sd


def _keep_local_experts(model_sd: dict, optim_sd: dict, experts: set[str], pg_collection) -> None:
    size, rank = pg_collection.ep_size, pg_collection.ep_rank
    for sd, key in _expert_tensors(model_sd, optim_sd, experts):
        rows = sd[key].shape[0] // size
        sd[key] = sd[key][rank * rows:(rank + 1) * rows]


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, step: int, pg_collection=None) -> None:
    """Write model, optimizer, scheduler and ``step`` (optimizer steps done) to ``path``. Collective."""
    model_sd, optim_sd = _full_state(model, optimizer, pg_collection)
    dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step},
             checkpoint_id=path)


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, pg_collection=None) -> int:
    """Restore what ``save_checkpoint`` wrote (in any layout) into the given objects; returns the step."""
    model_sd, optim_sd = _full_state(model, optimizer, pg_collection)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    model_sd, optim_sd = state["model"], state["optim"]
    if pg_collection is not None and pg_collection.ep_size > 1:
        _keep_local_experts(model_sd, optim_sd, expert_param_names(model), pg_collection)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


__all__ = ["save_checkpoint", "load_checkpoint"]
