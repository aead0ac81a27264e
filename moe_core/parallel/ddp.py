"""Data parallelism with replicated parameters: dense gradients summed over DP, expert gradients over expert-DP.

torch's ``DistributedDataParallel`` reduces every parameter over one process group, which fits when the experts
have nothing to reduce: their expert-DP mesh has one rank (``ep`` times ``expt_tp`` ranks span the world, as in
EP = 2 on 2 GPUs). Then the dense parameters take torch's DDP in place (``torch.distributed._composable.replicate``:
its C++ reducer sums buckets over DP while backward runs, and the parameters stay plain tensors at fixed
addresses) and the experts are left out. Otherwise (experts replicated over an expert-DP mesh of several ranks,
or dense tensor parallelism, whose DTensor parameters DDP does not take) FSDP2's ``replicate``
(``torch.distributed._composable.replicate_with_fsdp``, the DDP of torchtitan's FSDP2 stack) takes a mesh per
module, so the same per-block wrapping as ``apply_fsdp2`` works: experts on the expert-DP mesh, blocks and the
root on the DP mesh. FSDP2's hooks cost host time per block and call, and copy the parameters into new
buffers every forward, which is why torch's DDP goes first where it fits. Both run on gloo (CPU) and NCCL.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import replicate as ddp_replicate
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate

from moe_core.parallel.fsdp import ModelParts, wrap_per_block
from moe_core.parallel.process_groups import ProcessGroupCollection


def apply_ddp(model: nn.Module, pg_collection: ProcessGroupCollection, parts: ModelParts) -> nn.Module:
    """Replicate ``model`` in place for EP training (Megatron's default DDP); after backward each gradient is the
    sum over its mesh (dense: all DP ranks, experts: expert-DP).

    Experts whose expert-DP mesh has one rank have nothing to sum and stay unwrapped (``allreduce = False``,
    Megatron's mark of an expert parameter): a wrapper would copy each of their gradients into a reduce buffer
    and out again every step. Their parameters stay plain, so an optimizer must hold dense and expert parameters
    in separate groups (``training.step.build_optimizer`` does). Then, without dense TP, the dense parameters stay
    plain too, under torch's DDP, marked ``allreduce = True``; otherwise they become DTensors with a
    ``Replicate`` placement (FSDP2's ``replicate``). Either way ``model.set_requires_gradient_sync(False)`` defers
    the reduction (gradient accumulation over micro-batches). Call it on the allocated model (the marks do not
    survive ``to_empty``). See ``apply_fsdp2`` for the arguments.
    """
    if not ddp_keeps_parameters_in_place(pg_collection):
        return wrap_per_block(model, pg_collection, fsdp_replicate, parts, wrap_lone_experts=False)
    experts = list(parts.experts)
    expert_params = {p for module in experts for p in module.parameters()}
    for param in model.parameters():  # Megatron's marks; plain either way, so grad_clip checks the split by them
        param.allreduce = param not in expert_params
    device = next(model.parameters()).device
    # Its DDP holds the parameters only, so no buffer is broadcast (a router's token counts are each rank's own).
    ddp_replicate(model, ignored_modules=experts, process_group=pg_collection.dp,
                  device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    model.register_comm_hook(pg_collection.dp, _sum_hook)
    return model


def ddp_keeps_parameters_in_place(pg_collection: ProcessGroupCollection) -> bool:
    """Whether ``apply_ddp`` takes torch's DDP, whose parameters stay plain tensors at fixed addresses (CUDA
    graphs can replay over them), rather than FSDP2's ``replicate``: no dense TP and a one-rank expert-DP mesh."""
    return pg_collection.tp is None and pg_collection.expt_dp_mesh.size() == 1


def _sum_hook(group, bucket):
    # DDP's own reduction averages over the group; moe_core's losses are normalised by the global token count, so
    # gradients are summed (as FSDP2's force_sum_reduction_for_comms does on the other path). No annotations:
    # DDP checks them against dist.GradBucket, and postponed annotations are strings.
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


__all__ = ["apply_ddp", "ddp_keeps_parameters_in_place"]
