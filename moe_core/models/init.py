"""Deterministic initialisation of a ``GPTModel`` that is the same in every process layout.

A model too large for one device is built on the meta device, split (TP, EP) and sharded (FSDP2), then
allocated (``to_empty``) and initialised here, each rank filling only what it holds. The values are a function
of ``(seed, parameter name, global expert index)`` alone, never of the order in which a process draws them:

- each parameter (each expert of an expert tensor) draws from its own generator, seeded from a hash of the
  seed and its single-process name (``param_roles``: EP ranks name their experts by global index; a renamed
  parameter keeps its former name here, so a seed gives the weights it gave before the rename);
- the whole tensor (the rank's experts, for an expert tensor) is drawn on the parameter's device and this rank's
  shard is cut from it with the parameter's own DTensor placements (no communication).

So ``init_weights`` on the meta-built, sharded model of any layout gives the shards of ``init_weights`` on the
single-process model with the same seed (same device type). The rules are the constructors' (``init_rules``):
normal(0, ``init_method_std``) for matrices, ``init_method_std / sqrt(2 * num_layers)`` for the output
projections of attention and the MLPs (Megatron's output_layer_init_method), ones for RMSNorm weights, zeros
for biases and every buffer. The peak extra memory is one whole parameter (or one rank's experts of one).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moe_core.mlp import MLP
from moe_core.models.attention import SelfAttention
from moe_core.models.param_roles import param_roles
from moe_core.moe.experts import GroupedLinear, GroupedMLP
from moe_core.moe.router import TopKRouter
from moe_core.moe.shared_experts import SharedExpertMLP

ONES, ZEROS = "ones", "zeros"


def init_rules(model: nn.Module) -> dict[str, float | str]:
    """Every parameter name of ``model`` (a ``GPTModel``) -> the std of its normal init, ``"ones"`` or ``"zeros"``.

    Raises:
        ValueError: a parameter no rule covers (a module this function does not know).
    """
    cfg = model.config
    std, out_std = cfg.init_method_std, cfg.init_method_std / math.sqrt(2 * cfg.num_layers)
    rules: dict[str, float | str] = {"embedding.weight": std}
    if model.output_layer is not None:
        rules["output_layer.weight"] = std
    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        if isinstance(module, nn.RMSNorm):
            rules[f"{at}weight"] = ONES
        elif isinstance(module, SelfAttention):
            rules.update({f"{at}linear_qkv.weight": std, f"{at}linear_proj.weight": out_std})
        elif isinstance(module, (MLP, GroupedMLP)):  # dense MLP, shared expert, experts
            rules.update({f"{at}linear_fc1.weight": std, f"{at}linear_fc2.weight": out_std})
            if isinstance(module, SharedExpertMLP) and module.gate_weight is not None:
                rules[f"{at}gate_weight"] = std
        elif isinstance(module, TopKRouter):
            rules[f"{at}weight"] = std
        elif isinstance(module, (nn.Linear, GroupedLinear)) and module.bias is not None:
            rules[f"{at}bias"] = ZEROS
    missing = sorted(name for name, _ in model.named_parameters() if name not in rules)
    if missing:
        raise ValueError(f"model: no initialisation rule for {missing}")
    return rules


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _normal(shape: tuple[int, ...], std: float, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, std, generator=generator).to(dtype)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, expert_offset: int = 0) -> None:
    """Initialise every parameter and buffer of ``model`` in place (module docstring).

    Args:
        model: a ``GPTModel``, possibly split by TP / ETP (DTensor parameters), holding ``E / EP`` experts and
            sharded by FSDP2 or replicate; allocated (not on the meta device).
        seed: the run's seed.
        expert_offset: global index of this rank's first expert (``ep_rank * E / EP``; 0 without EP).
    Raises:
        ValueError: a parameter without a rule (``init_rules``), or on the meta device.
    """
    rules = init_rules(model)
    roles = param_roles(model, expert_offset)
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            raise ValueError(f"model: {name} is on the meta device; allocate the model first (to_empty)")
        local = param.to_local() if isinstance(param, DTensor) else param
        rule = rules[name]
        if rule in (ONES, ZEROS):
            local.fill_(1.0 if rule == ONES else 0.0)
            continue
        role = roles[name]
        # Seeded by the name a parameter had when its seeds were defined: a rename keeps a seed's weights.
        seed_name = role.former_name or role.name
        if role.stacked:  # [L, ...]: a generator per global expert
            full = torch.stack([_normal(tuple(param.shape[1:]), rule, _seed(seed, f"{seed_name}[{expert_offset + e}]"),
                                        param.device, param.dtype) for e in range(param.shape[0])])
        else:
            full = _normal(tuple(param.shape), rule, _seed(seed, seed_name), param.device, param.dtype)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        local.copy_(full)
    for buffer in model.buffers():
        buffer.zero_()


__all__ = ["init_rules", "init_weights"]
