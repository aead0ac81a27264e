"""Checkpoints with torch.distributed.checkpoint (DCP): sharded-aware model and optimizer state, any layout.

``get_state_dict`` / ``set_state_dict`` give full-parameter-name state dicts for plain, DDP and FSDP2 models
alike, so a checkpoint saved by one process layout loads in another. Without a process group DCP runs in
its single-process mode.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Write model, optimizer, scheduler and ``step`` (the number of optimizer steps done) to ``path``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step},
             checkpoint_id=path)


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
    """Restore what ``save_checkpoint`` wrote into the given objects; returns the step to resume from."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


__all__ = ["save_checkpoint", "load_checkpoint"]
