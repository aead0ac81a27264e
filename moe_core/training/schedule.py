"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr`` (Megatron's OptimizerParamScheduler)."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, lr: float, min_lr: float, warmup_iters: int, train_iters: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): ``lr * (step + 1) / warmup`` during warmup,
    then ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2`` with progress 0 -> 1 over the rest."""
    if step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    decay_iters = max(train_iters - warmup_iters, 1)
    progress = min((step - warmup_iters) / decay_iters, 1.0)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, lr: float, min_lr: float, warmup_iters: int,
                    train_iters: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following ``lr_at``; every param group must start with ``lr`` as its lr."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, lr, min_lr, warmup_iters, train_iters) / lr
    )


__all__ = ["lr_at", "build_scheduler"]
