"""Process groups for tensor, data and expert parallelism, built once from torch.distributed DeviceMeshes.

Layout (Megatron-LM's, megatron/core/parallel_state.py with PP = CP = 1). Dense parameters and expert
parameters each see the world as a mesh of their own, innermost dimension last:

    dense    W = dp * tp                  rank = dp_rank * tp + tp_rank
    experts  W = expt_dp * ep * expt_tp   rank = (expt_dp_rank * ep + ep_rank) * expt_tp + expt_tp_rank

    tp       tp consecutive ranks     split attention heads and MLP columns/rows (``tensor_parallel``); they
                                      see the same micro-batch, each a 1/tp slice of its sequence
    dp       ranks with the same      train on different micro-batches; dense parameters are replicated
             tp_rank                  (DDP) or sharded (FSDP2) over it
    expt_tp  expt_tp consecutive      split each expert's fc1 columns / fc2 rows (ETP); 1 or tp, and then
             ranks                    the same ranks as tp
    ep       ranks with the same      split the experts; tokens travel between them by all-to-all
             expt_dp and expt_tp rank
    expt_dp  ranks with the same ep   replicate (DDP) or shard (FSDP2) the expert parameters they share
             and expt_tp rank

With TP 1 every rank is a data-parallel rank and EP is carved out of data parallelism; with ETP 1 the EP
ranks may span TP ranks, whose tokens differ. Contiguous TP and EP ranks keep their collectives inside a
node. The groups travel explicitly in a ``ProcessGroupCollection`` (Megatron's ``pg_collection``): there is
no module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ProcessGroupCollection:
    """The groups and meshes one rank needs (Megatron's ``ProcessGroupCollection``).

    Attributes:
        dp_mesh: 1-D mesh ``("dp",)``; FSDP2/replicate mesh of the dense parameters (every rank at TP 1).
        expert_mesh: ``("expt_dp", "ep")``, with a third dimension ``"expt_tp"`` when ETP > 1;
            ``expert_mesh["ep"]`` splits the experts, ``expert_mesh["expt_dp"]`` is the FSDP2/replicate mesh
            of the expert parameters.
        dp, ep, expt_dp: the process groups of those mesh dimensions.
        tp_mesh: 1-D mesh ``("tp",)`` of this rank's TP group, a dimension of ``dp_mesh``'s 2-D parent
            ``("dp", "tp")``; None at TP 1.
        tp, expt_tp: the TP and ETP groups; None at size 1.
    """

    dp_mesh: DeviceMesh
    expert_mesh: DeviceMesh
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    expt_dp: dist.ProcessGroup
    tp_mesh: DeviceMesh | None = None
    tp: dist.ProcessGroup | None = None
    expt_tp: dist.ProcessGroup | None = None

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

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else dist.get_world_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else dist.get_rank(self.tp)

    @property
    def expt_tp_size(self) -> int:
        return 1 if self.expt_tp is None else dist.get_world_size(self.expt_tp)

    @property
    def expt_tp_mesh(self) -> DeviceMesh | None:
        """1-D mesh of this rank's ETP group, None at ETP 1."""
        return self.expert_mesh["expt_tp"] if self.expt_tp is not None else None

    @property
    def tp_dp(self) -> dist.ProcessGroup:
        """Every rank whose tokens differ: TP x DP, the whole world (Megatron's ``tp_dp_cp`` with CP 1).
        Router load counts and global aux-loss counts sum over it."""
        return dist.group.WORLD

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


def check_parallel_sizes(world: int, expert_model_parallel_size: int, tensor_model_parallel_size: int = 1,
                         expert_tensor_parallel_size: int | None = None) -> int:
    """The ETP size (None: the TP size) once every size is checked against the world size.

    Raises:
        TypeError: a size is not an int.
        ValueError: a size is not positive, ETP is neither 1 nor TP, TP does not divide the world, or
            EP x ETP does not.
    """
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    sizes = {"expert_model_parallel_size": expert_model_parallel_size,
             "tensor_model_parallel_size": tensor_model_parallel_size,
             "expert_tensor_parallel_size": expert_tensor_parallel_size}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"{name}: expected int, got {type(size).__name__}")
        if size < 1:
            raise ValueError(f"{name} ({size}) must be a positive int")
    tp, ep, etp = tensor_model_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size
    if etp not in (1, tp):
        raise ValueError(f"expert_tensor_parallel_size: expected 1 or tensor_model_parallel_size ({tp}), got {etp}")
    if world % tp:
        raise ValueError(f"tensor_model_parallel_size ({tp}) must divide the world size ({world})")
    if world % (ep * etp):
        what = f"expert_model_parallel_size ({ep})" + (f" x expert_tensor_parallel_size ({etp})" if etp > 1 else "")
        raise ValueError(f"{what} must be a positive divisor of the world size ({world})")
    return etp


def build_process_groups(
    expert_model_parallel_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    num_moe_experts: int | None = None,
    device_type: str | None = None,
) -> ProcessGroupCollection:
    """Build the groups of the module docstring. Collective: call on every rank.

    Args:
        expert_model_parallel_size: EP size; EP x ETP must divide the world size.
        tensor_model_parallel_size: TP size; must divide the world size.
        expert_tensor_parallel_size: ETP size, 1 or the TP size; None: the TP size (Megatron's default).
        num_moe_experts: when given, must be divisible by ``expert_model_parallel_size``.
        device_type: mesh device type; default ``"cuda"`` for NCCL, ``"cpu"`` otherwise.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError / ValueError: as ``check_parallel_sizes``, or experts that do not split over EP.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_process_groups: call torch.distributed.init_process_group first")
    world = dist.get_world_size()
    tp, ep = tensor_model_parallel_size, expert_model_parallel_size
    etp = check_parallel_sizes(world, ep, tp, expert_tensor_parallel_size)
    if num_moe_experts is not None:
        check_expert_split(num_moe_experts, ep)
    device_type = device_type or default_device_type()
    expt_dp = world // (ep * etp)
    if etp == 1:
        expert_mesh = init_device_mesh(device_type, (expt_dp, ep), mesh_dim_names=("expt_dp", "ep"))
    else:
        expert_mesh = init_device_mesh(device_type, (expt_dp, ep, etp), mesh_dim_names=("expt_dp", "ep", "expt_tp"))
    tp_mesh = None
    if tp == 1:
        # A 1-D mesh over the whole world reuses the default group instead of creating another one.
        dp_mesh = DeviceMesh(device_type, torch.arange(world), mesh_dim_names=("dp",))
    else:
        dense_mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = dense_mesh["dp"], dense_mesh["tp"]
    return ProcessGroupCollection(
        dp_mesh=dp_mesh,
        expert_mesh=expert_mesh,
        dp=dp_mesh.get_group(),
        ep=expert_mesh["ep"].get_group(),
        expt_dp=expert_mesh["expt_dp"].get_group(),
        tp_mesh=tp_mesh,
        tp=None if tp_mesh is None else tp_mesh.get_group(),
        expt_tp=None if etp == 1 else expert_mesh["expt_tp"].get_group(),
    )


def check_tp_sizes(config, pg_collection: ProcessGroupCollection | None) -> None:
    """Raise ``ValueError`` unless ``pg_collection``'s TP and ETP sizes (1 for None) are the config's
    ``tensor_model_parallel_size`` and ``expert_tensor_parallel_size``."""
    tp = 1 if pg_collection is None else pg_collection.tp_size
    etp = 1 if pg_collection is None else pg_collection.expt_tp_size
    if (tp, etp) != (config.tensor_model_parallel_size, config.expert_tensor_parallel_size):
        raise ValueError(
            f"pg_collection: TP size {tp} and ETP size {etp} (1 when None) differ from the config's "
            f"tensor_model_parallel_size ({config.tensor_model_parallel_size}) and expert_tensor_parallel_size "
            f"({config.expert_tensor_parallel_size})"
        )


__all__ = [
    "ProcessGroupCollection", "build_process_groups", "check_expert_split", "check_ep_size", "check_parallel_sizes",
    "check_tp_sizes", "default_device_type",
]
