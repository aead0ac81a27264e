"""Token-mean loss that gives the same gradients whatever the DP x EP layout.

Megatron's ``calculate_per_token_loss``: every rank sums its per-token losses and divides by the number of
tokens in the *global* batch (all DP ranks, all micro-batches of the step); the data-parallel wrappers then
*sum* gradients (``fsdp.py`` / ``ddp.py`` set a divide factor of 1). The sum over ranks of
``d(local_sum) / global_tokens`` is exactly the gradient of the single-process mean, so no gradient is ever
averaged over the wrong group (dense over DP, experts over expert-DP would otherwise differ by ep).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_core.parallel.collective_errors import named_collective


def global_token_count(num_local_tokens: torch.Tensor | int, group: dist.ProcessGroup | None,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Sum of ``num_local_tokens`` over ``group`` (one all-reduce), as an int64 scalar tensor.

    Call once per optimizer step with the tokens of all this rank's micro-batches; ``group`` is the DP group
    (``pg_collection.dp``), ``None`` for one process.
    """
    count = torch.as_tensor(num_local_tokens, dtype=torch.int64, device=device).clone()
    if group is not None and dist.get_world_size(group) > 1:
        with named_collective("all_reduce (global token count)", group):
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count


def token_mean_loss(loss_per_token: torch.Tensor, num_global_tokens: torch.Tensor | int,
                    loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(loss_per_token * loss_mask) / num_global_tokens``: this rank's share of the global mean.

    Args:
        loss_per_token: any shape, float.
        num_global_tokens: from ``global_token_count`` (counted with the same mask).
        loss_mask: same shape as ``loss_per_token``, 1 for tokens that count; ``None`` counts all.
    Raises:
        ValueError: ``loss_mask`` has another shape.
    """
    if loss_mask is not None:
        if loss_mask.shape != loss_per_token.shape:
            raise ValueError(
                f"loss_mask: expected shape {tuple(loss_per_token.shape)}, got {tuple(loss_mask.shape)}"
            )
        loss_per_token = loss_per_token * loss_mask
    return loss_per_token.float().sum() / num_global_tokens


def reduce_loss_for_logging(local_loss: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of the detached ``token_mean_loss`` values over ``group``: the global token-mean loss."""
    value = local_loss.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        with named_collective("all_reduce (loss)", group):
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


__all__ = ["global_token_count", "token_mean_loss", "reduce_loss_for_logging"]
