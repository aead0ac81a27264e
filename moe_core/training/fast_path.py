"""The trainer's default execution path: the fastest one that applies, from the configs alone.

Three settings default to None, "the trainer decides": ``moe_dispatch_sync_free``, ``moe_shared_expert_overlap``
(``TransformerConfig``) and ``enable_cuda_graph`` (``TrainingConfig``). ``resolve_fast_path`` turns each None into
True where it applies and False elsewhere, with a note saying why it does not apply; True and False given by the
user stay (the flags opt out, or insist: an insisted path that cannot apply is an error, as before).

- Sync-free dispatch: under EP on CUDA with the all-to-all dispatcher, without drop_and_pad (already static) and
  without dense TP. On the CPU the host sync it removes costs nothing.
- CUDA graphs: compiled layers on CUDA, with parameters at fixed addresses (one process, or DDP with one rank per
  expert-DP mesh and no TP: not FSDP2), static shapes (under EP the sync-free dispatch; no capacity factor, whose
  dropped rows change with the routing), and no activation recompute (untested with graph replay).
- Shared-expert overlap: a shared expert under EP on CUDA (eager layers; a compiled layer orders it itself).
"""

from __future__ import annotations

import dataclasses

import torch

from moe_core.config import TransformerConfig
from moe_core.parallel.ddp import ddp_keeps_parameters_in_place
from moe_core.parallel.process_groups import ProcessGroupCollection
from moe_core.training.config import TrainingConfig


def resolve_fast_path(model_config: TransformerConfig, cfg: TrainingConfig,
                      pg_collection: ProcessGroupCollection | None, device: torch.device
                      ) -> tuple[TransformerConfig, TrainingConfig, list[str]]:
    """``(model_config, cfg, notes)`` with the None settings of the module docstring resolved; ``notes`` says, for
    each one left off where it would have been worth having, why."""
    notes: list[str] = []
    cuda = device.type == "cuda"
    ep = model_config.expert_model_parallel_size
    sync_free = model_config.moe_dispatch_sync_free
    if sync_free is None:
        why = _sync_free_blocker(model_config) if cuda and ep > 1 else "no EP on CUDA"
        sync_free = why is None
        if why is not None and cuda and ep > 1:
            notes.append(f"moe_dispatch_sync_free off: {why}")
    overlap = model_config.moe_shared_expert_overlap
    if overlap is None:
        overlap = cuda and ep > 1 and model_config.moe_shared_expert_intermediate_size is not None
    model_config = dataclasses.replace(model_config, moe_dispatch_sync_free=sync_free,
                                       moe_shared_expert_overlap=overlap)
    graphs = cfg.enable_cuda_graph
    if graphs is None:
        why = _cuda_graph_blocker(model_config, cfg, pg_collection) if cuda and cfg.compile else "not compiled on CUDA"
        graphs = why is None
        if why is not None and cuda and cfg.compile:
            notes.append(f"enable_cuda_graph off: {why}")
        cfg = dataclasses.replace(cfg, enable_cuda_graph=graphs)
    return model_config, cfg, notes


def _sync_free_blocker(config: TransformerConfig) -> str | None:
    if config.moe_token_dispatcher_type != "alltoall":
        return f"the {config.moe_token_dispatcher_type} dispatcher has no sync-free exchange"
    if config.moe_pad_expert_input_to_capacity:
        return "drop_and_pad's exchange is static already"
    if config.tensor_model_parallel_size > 1:
        return f"tensor_model_parallel_size {config.tensor_model_parallel_size} (not tested with TP)"
    return None


def _cuda_graph_blocker(config: TransformerConfig, cfg: TrainingConfig,
                        pg_collection: ProcessGroupCollection | None) -> str | None:
    if cfg.use_torch_fsdp2:
        return "use_torch_fsdp2 allocates the parameters anew every step"
    if pg_collection is not None and not ddp_keeps_parameters_in_place(pg_collection):
        return (f"DDP keeps parameters in place only without TP and with one rank per expert-DP mesh (TP "
                f"{pg_collection.tp_size}, expert-DP {pg_collection.expt_dp_mesh.size()})")
    if config.expert_model_parallel_size > 1 and not config.moe_dispatch_sync_free:
        return "the EP dispatch is not sync-free (its row counts change every step)"
    if config.moe_expert_capacity_factor is not None and not config.moe_pad_expert_input_to_capacity:
        return "a capacity factor without padding drops a different number of rows every step"
    if config.recompute_granularity is not None:
        return "activation recompute"
    return None


__all__ = ["resolve_fast_path"]
