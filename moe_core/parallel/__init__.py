"""Expert parallelism: process groups, differentiable collectives, FSDP2/DDP wrapping, loss and clipping."""

from moe_core.parallel.process_groups import ProcessGroupCollection, build_process_groups

__all__ = ["ProcessGroupCollection", "build_process_groups"]
