"""Process groups for expert parallelism, built once from a torch.distributed DeviceMesh.

Layout (Megatron-LM's, megatron/core/parallel_state.py with TP = PP = CP = 1): every rank is a data-parallel
rank that trains on its own micro-batch, and expert parallelism (EP) is carved out of data parallelism.

    world W = expt_dp * ep          rank = expt_dp_rank * ep + ep_rank   (EP ranks are contiguous)
    dp       all W ranks            dense parameters are replicated (DDP) or sharded (FSDP2) over it
    ep       ep consecutive ranks   split the experts; tokens travel between them by all-to-all
    expt_dp  ranks with the same    replicate (DDP) or shard (FSDP2) the expert parameters they share
             ep_rank

Contiguous EP ranks keep the token all-to-all inside a node. The groups travel explicitly in a
``ProcessGroupCollection`` (Megatron's ``pg_collection``): there is no module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ProcessGroupCollection:
    """The groups and meshes one rank needs for EP training (Megatron's ``ProcessGroupCollection``).

    Attributes:
        dp_mesh: 1-D mesh ``("dp",)`` over all ranks; FSDP2/replicate mesh of the dense parameters.
        expert_mesh: 2-D mesh ``("expt_dp", "ep")``; ``expert_mesh["ep"]`` splits the experts,
            ``expert_mesh["expt_dp"]`` is the FSDP2/replicate mesh of the expert parameters.
        dp, ep, expt_dp: the process groups of those mesh dimensions.
    """

    dp_mesh: DeviceMesh
    expert_mesh: DeviceMesh
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    expt_dp: dist.ProcessGroup

    @property
    def ep_mesh(self) -> DeviceMesh:
        """1-D mesh of this rank's EP group."""
        return self.expert_mesh["ep"]

    @property
    def expt_dp_mesh(self) -> DeviceMesh:
        """1-D mesh of the ranks holding the same experts as this one."""
        return self.expert_mesh["expt_dp"]

    @property
    def ep_size(self) -> int:
        return dist.get_world_size(self.ep)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp)

    @property
    def expt_dp_size(self) -> int:
        return dist.get_world_size(self.expt_dp)

    def local_expert_indices(self, num_moe_experts: int) -> list[int]:
        """Global ids of the L experts this rank holds: ``ep_rank * L + [0, L)``."""
        check_expert_split(num_moe_experts, self.ep_size)
        num_local = num_moe_experts // self.ep_size
        return list(range(self.ep_rank * num_local, (self.ep_rank + 1) * num_local))


def check_expert_split(num_moe_experts: int, expert_model_parallel_size: int) -> None:
    """Raise ``ValueError`` unless ``num_moe_experts`` splits evenly over ``expert_model_parallel_size`` ranks."""
    if num_moe_experts < 1 or num_moe_experts % expert_model_parallel_size:
        raise ValueError(
            f"num_moe_experts ({num_moe_experts}) must be a positive multiple of "
            f"expert_model_parallel_size ({expert_model_parallel_size})"
        )


def check_ep_size(expert_model_parallel_size: int, pg_collection: ProcessGroupCollection | None) -> int:
    """The EP size of ``pg_collection`` (1 for None) once it is checked to equal the config's.

    ``TransformerConfig.expert_model_parallel_size`` sizes the model (``num_local_experts``) and the groups
    place the experts; models call this at construction so the two cannot disagree.

    Raises:
        ValueError: the sizes differ.
    """
    ep_size = 1 if pg_collection is None else pg_collection.ep_size
    if ep_size != expert_model_parallel_size:
        raise ValueError(
            f"pg_collection: EP size {ep_size} (1 when None) differs from the config's expert_model_parallel_size "
            f"({expert_model_parallel_size})"
        )
    return ep_size


def default_device_type() -> str:
    """``"cuda"`` when the default process group is NCCL, else ``"cpu"``."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def build_process_groups(
    expert_model_parallel_size: int,
    *,
    num_moe_experts: int | None = None,
    device_type: str | None = None,
) -> ProcessGroupCollection:
    """Build the DP / EP / expert-DP groups of the module docstring. Collective: call on every rank.

    Args:
        expert_model_parallel_size: EP size; must divide the world size.
        num_moe_experts: when given, must be divisible by ``expert_model_parallel_size``.
        device_type: mesh device type; default ``"cuda"`` for NCCL, ``"cpu"`` otherwise.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError / ValueError: a size is not an int, not positive, or does not divide.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_process_groups: call torch.distributed.init_process_group first")
    if isinstance(expert_model_parallel_size, bool) or not isinstance(expert_model_parallel_size, int):
        raise TypeError(
            f"expert_model_parallel_size: expected int, got {type(expert_model_parallel_size).__name__}"
        )
    world = dist.get_world_size()
    if expert_model_parallel_size < 1 or world % expert_model_parallel_size:
        raise ValueError(
            f"expert_model_parallel_size ({expert_model_parallel_size}) must be a positive divisor of "
            f"the world size ({world})"
        )
    if num_moe_experts is not None:
        check_expert_split(num_moe_experts, expert_model_parallel_size)
    device_type = device_type or default_device_type()
    expt_dp = world // expert_model_parallel_size
    expert_mesh = init_device_mesh(
        device_type, (expt_dp, expert_model_parallel_size), mesh_dim_names=("expt_dp", "ep")
    )
    # A 1-D mesh over the whole world reuses the default group instead of creating another one.
    dp_mesh = DeviceMesh(device_type, torch.arange(world), mesh_dim_names=("dp",))
    return ProcessGroupCollection(
        dp_mesh=dp_mesh,
        expert_mesh=expert_mesh,
        dp=dp_mesh.get_group(),
        ep=expert_mesh["ep"].get_group(),
        expt_dp=expert_mesh["expt_dp"].get_group(),
    )


__all__ = [
    "ProcessGroupCollection", "build_process_groups", "check_expert_split", "check_ep_size", "default_device_type",
]
