"""Checkpoints with torch.distributed.checkpoint (DCP) that load in any process layout.

The state is saved in the single-process layout: full tensors (``get_state_dict(full_state_dict=True)``
gathers FSDP2 shards and replicated DTensors) with every expert tensor gathered over expert parallelism
(``[E, ...]``, EP rank r's rows ``[r * L, (r + 1) * L)``). Every rank then holds identical tensors and DCP
writes each once; loading slices this rank's experts and lets ``set_state_dict`` re-shard. Gathering under
the same names matters: EP ranks hold *different* experts under the same parameter name, which DCP would
otherwise treat as one replicated tensor and keep only one rank's copy. Full tensors on every rank suit
the model sizes this trainer runs; without a process group DCP runs in its single-process mode.

Besides the model, optimizer, scheduler and step, a checkpoint holds what makes a resumed run continue the
same trajectory: the data seed (batches are a function of ``(seed, step)``, ``data.sample_batch``) and each
rank's torch RNG states (CPU, and CUDA when used: router input jitter draws from them), under a per-rank key
so ranks with different streams don't collapse into one replicated entry. Loaded into another world size, a
rank without its own entry keeps its freshly seeded RNG.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from moe_core.parallel.collectives import all_gather_first_dim
from moe_core.parallel.process_groups import ProcessGroupCollection
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


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                pg_collection: ProcessGroupCollection | None) -> tuple[dict, dict]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    if pg_collection is not None and pg_collection.ep_size > 1:
        for sd, key in _expert_tensors(model_sd, optim_sd, expert_param_names(model)):
            sd[key] = all_gather_first_dim(sd[key].contiguous(), pg_collection.ep)
    return model_sd, optim_sd


def _keep_local_experts(model_sd: dict, optim_sd: dict, experts: set[str], pg_collection: ProcessGroupCollection
                        ) -> None:
    size, rank = pg_collection.ep_size, pg_collection.ep_rank
    for sd, key in _expert_tensors(model_sd, optim_sd, experts):
        rows = sd[key].shape[0] // size
        sd[key] = sd[key][rank * rows:(rank + 1) * rows]


def _rng_key() -> str:
    return f"rank{dist.get_rank() if dist.is_initialized() else 0}"


def _rng_state() -> dict[str, torch.Tensor]:
    """This process's torch RNG states: ``cpu`` (and ``cuda``, the current device's, once CUDA is in use)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, step: int,
                    pg_collection: ProcessGroupCollection | None = None, *, seed: int) -> None:
    """Write model, optimizer, scheduler, ``step`` (optimizer steps done), the data ``seed`` and this rank's
    RNG states to the directory ``path``. Collective over all ranks."""
    model_sd, optim_sd = _full_state(model, optimizer, pg_collection)
    dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step,
              "seed": seed, "rng": {_rng_key(): _rng_state()}}, checkpoint_id=path)


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler,
                    pg_collection: ProcessGroupCollection | None = None, *, seed: int | None = None) -> int:
    """Restore what ``save_checkpoint`` wrote (in any layout) into the given objects and this rank's RNG
    states; returns the step.

    Raises:
        ValueError: ``seed`` is given and differs from the checkpoint's (the resumed run would draw other
            batches than the saved run).
    """
    model_sd, optim_sd = _full_state(model, optimizer, pg_collection)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": 0, "seed": 0}
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    rng = _rng_state()
    # Only the entries this checkpoint has: another world size, or no CUDA when it was saved.
    rng = {k: v for k, v in rng.items() if f"rng.{_rng_key()}.{k}" in saved_keys}
    if rng:
        state["rng"] = {_rng_key(): rng}
    dcp.load(state, checkpoint_id=path)
    if seed is not None and int(state["seed"]) != seed:
        raise ValueError(f"seed: the checkpoint in {path} was trained with seed {state['seed']}, got {seed}")
    model_sd, optim_sd = state["model"], state["optim"]
    if pg_collection is not None and pg_collection.ep_size > 1:
        _keep_local_experts(model_sd, optim_sd, expert_param_names(model), pg_collection)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
    scheduler.load_state_dict(state["scheduler"])
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    return int(state["step"])


def load_model_weights(path: str, model: torch.nn.Module, pg_collection=None) -> None:
    """Restore only the model's weights from a ``save_checkpoint`` directory (Megatron's ``--finetune``): the
    optimizer, schedule, step, seed and RNG states stay fresh. Any process layout, like ``load_checkpoint``."""
    model_sd = get_model_state_dict(model, options=_OPTIONS)
    no_optim = {"state": {}}
    experts = expert_param_names(model)
    if pg_collection is not None and pg_collection.ep_size > 1:
        for sd, key in _expert_tensors(model_sd, no_optim, experts):
            sd[key] = all_gather_first_dim(sd[key].contiguous(), pg_collection.ep)
    state = {"model": model_sd}
    dcp.load(state, checkpoint_id=path)
    if pg_collection is not None and pg_collection.ep_size > 1:
        _keep_local_experts(state["model"], no_optim, experts, pg_collection)
    set_model_state_dict(model, state["model"], options=_OPTIONS)


__all__ = ["save_checkpoint", "load_checkpoint", "load_model_weights"]
