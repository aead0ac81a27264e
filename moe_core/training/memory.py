"""Refuse a model that cannot fit before allocating it: its training footprint estimated from the config.

Training holds, per parameter, a float32 weight, a float32 gradient and AdamW's two float32 moments: 16 bytes.
However TP, EP, DDP and FSDP2 place them, the ranks together hold at least the whole model's 16 bytes a
parameter, in equal shares, so every rank holds at least ``1 / world`` of it: a lower bound, which refuses only
what cannot fit.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.parallel.collective_errors import named_collective
from moe_core.parallel.process_groups import ProcessGroupCollection

BYTES_PER_PARAMETER = 16  # float32 weight, gradient and AdamW's two moments


def num_parameters(config: TransformerConfig) -> int:
    """``GPTModel(config.single_process()).num_parameters()`` (every expert), computed from one-layer models on
    the meta device, so its cost does not grow with ``num_layers``."""
    single = dataclasses.replace(config.single_process(), num_layers=1, first_k_dense_replace=0, moe_layer_freq=1)
    kinds = [dataclasses.replace(single, num_moe_experts=None)]
    if config.num_moe_experts is not None:
        kinds.append(single)
    with torch.device("meta"):
        models = [GPTModel(kind) for kind in kinds]
    per_layer = [sum(p.numel() for p in model.decoder.layers.parameters()) for model in models]
    outside_layers = models[0].num_parameters() - per_layer[0]  # embedding, output layer, final norm
    moe_layers = num_moe_layers(config)
    return outside_layers + (config.num_layers - moe_layers) * per_layer[0] + moe_layers * per_layer[-1]


def num_moe_layers(config: TransformerConfig) -> int:
    """How many layers ``config.is_moe_layer`` makes MoE, counted without a loop over the layers."""
    if config.num_moe_experts is None:
        return 0
    first = config.first_k_dense_replace
    if isinstance(config.moe_layer_freq, list):
        return sum(config.moe_layer_freq[first:])
    freq = config.moe_layer_freq
    return -(-config.num_layers // freq) - -(-first // freq)  # multiples of freq in [first, num_layers)


def available_bytes(device: torch.device) -> int:
    """Memory this process may still allocate on ``device``: CUDA's free memory, or the host's available RAM
    (``MemAvailable`` of /proc/meminfo; elsewhere, the free pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_model_fits(config: TransformerConfig, device: torch.device,
                     pg_collection: ProcessGroupCollection | None = None) -> None:
    """Raise unless the least a rank must hold for training (module docstring) fits in the least memory any rank
    has available on ``device``. Under ``pg_collection`` collective over all ranks (one all-reduce), so every rank
    takes the same branch.

    Raises:
        ValueError: it cannot fit; names the parameter count, the bytes needed and the bytes available.
    """
    world_size = 1 if pg_collection is None else dist.get_world_size()
    params = num_parameters(config)
    needed = BYTES_PER_PARAMETER * params // world_size
    least = torch.tensor([available_bytes(device)], dtype=torch.int64, device=device)
    if pg_collection is not None:
        with named_collective("all_reduce (available memory)"):
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
    available = int(least.item())
    if needed > available:
        raise ValueError(
            f"model: {params:,} parameters (num_layers {config.num_layers}, hidden_size {config.hidden_size}, "
            f"num_moe_experts {config.num_moe_experts}) need at least {needed / 2**30:,.1f} GiB per rank for "
            f"training ({BYTES_PER_PARAMETER} bytes a parameter over {world_size} ranks); {device.type} has "
            f"{available / 2**30:,.1f} GiB available"
        )


__all__ = ["BYTES_PER_PARAMETER", "num_parameters", "num_moe_layers", "available_bytes", "check_model_fits"]
