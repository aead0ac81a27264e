"""Expert parallelism: process groups, differentiable collectives, FSDP2/DDP wrapping, loss and clipping."""

from moe_core.parallel.ddp import apply_ddp
from moe_core.parallel.fsdp import ModelParts, apply_fsdp2, split_expert_params
from moe_core.parallel.grad_clip import clip_grad_norm_, get_grad_norm
from moe_core.parallel.launch import init_distributed, rank_slice
from moe_core.parallel.loss import global_token_count, reduce_loss_for_logging, token_mean_loss
from moe_core.parallel.process_groups import ProcessGroupCollection, build_process_groups, check_ep_size

__all__ = [
    "ProcessGroupCollection", "build_process_groups", "check_ep_size", "init_distributed", "rank_slice",
    "ModelParts", "apply_ddp", "apply_fsdp2", "split_expert_params", "clip_grad_norm_", "get_grad_norm",
    "global_token_count", "token_mean_loss", "reduce_loss_for_logging",
]
