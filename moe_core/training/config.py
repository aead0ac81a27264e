"""TrainingConfig: the ``training:`` section of a run's YAML (Megatron's argument names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(kw_only=True)
class TrainingConfig:
    micro_batch_size: int = 32
    """Sequences per forward on one rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all ranks; None: micro_batch_size * data-parallel size.
    Gradient accumulation runs global / (micro * dp) micro-batches."""
    train_iters: int = 100
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iters: int = 0
    """Linear warmup steps from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on 2-D+ weights (not on norms or biases)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Max global gradient norm (0 disables clipping; the norm is still logged)."""
    log_interval: int = 10
    """Steps between metric lines."""
    eval_interval: int | None = None
    """Steps between validation evaluations (also at step 0 and at the end); None: start and end only."""
    eval_iters: int = 10
    """Validation batches (of micro_batch_size * data-parallel size sequences) per evaluation."""
    save: str | None = None
    """Checkpoint directory (torch.distributed.checkpoint); written at the end and every save_interval."""
    save_interval: int | None = None
    """Steps between checkpoints; None: only at the end."""
    load: str | None = None
    """Checkpoint directory to resume from (same seed and schedule: the run continues the saved trajectory)."""
    finetune: bool = False
    """With ``load``: take the model's weights only and start at step 0 with a fresh optimizer and schedule
    (Megatron's --finetune; e.g. from ``tools/hf_checkpoint.py import``)."""
    exit_interval: int | None = None
    """Stop (evaluate, save) after the first step that is a multiple of this; the LR schedule still spans
    train_iters, so a later --load continues the same run (Megatron's --exit-interval)."""
    seed: int = 1234
    """Seed of the initialisation and of every batch (batches are a function of seed and step)."""
    data_path: list[str] | None = None
    """Text or JSONL files; None: the Python standard library's .py sources."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer.json; None: bytes (vocab 256)."""
    output_dir: str = "runs/default"
    """Metrics JSONL and the loss-curve PNG go here (and TensorBoard events unless tensorboard_dir is set)."""
    tensorboard_dir: str | None = None
    """TensorBoard event directory; None: output_dir/tensorboard."""
    bf16: bool = True
    """bf16 on CUDA: autocast, or FSDP2's MixedPrecisionPolicy under use_torch_fsdp2 (ignored on CPU, where
    training runs in float32)."""
    use_torch_fsdp2: bool = False
    """Shard parameters with FSDP2 (fully_shard); data-parallel replication (DDP) otherwise."""
    compile: bool = False
    """torch.compile each transformer layer (torchtitan's per-block compile)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "train_iters", "log_interval", "eval_iters"):
            _check_int(name, getattr(self, name), optional=False)
        for name in ("global_batch_size", "eval_interval", "save_interval", "exit_interval"):
            _check_int(name, getattr(self, name), optional=True)
        _check_int("seed", self.seed, optional=False, minimum=0)
        _check_int("lr_warmup_iters", self.lr_warmup_iters, optional=False, minimum=0)
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(
                f"lr, min_lr: expected 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}"
            )
        if self.lr_warmup_iters > self.train_iters:
            raise ValueError(
                f"lr_warmup_iters: expected 0..train_iters ({self.train_iters}), got {self.lr_warmup_iters}"
            )
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad: expected >= 0, got {self.clip_grad}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: expected >= 0, got {self.weight_decay}")
        if self.finetune and not self.load:
            raise ValueError("finetune: expected a checkpoint to take the weights from (load), got load=None")
        if isinstance(self.data_path, str):
            self.data_path = [self.data_path]

    def num_micro_batches(self, dp_size: int) -> int:
        """Gradient-accumulation steps for ``dp_size`` data-parallel ranks.

        Raises:
            ValueError: global_batch_size is not a multiple of micro_batch_size * dp_size.
        """
        per_step = self.micro_batch_size * dp_size
        global_batch = self.global_batch_size or per_step
        if global_batch % per_step:
            raise ValueError(
                f"global_batch_size ({global_batch}) must be a multiple of micro_batch_size x data-parallel size "
                f"({self.micro_batch_size} x {dp_size})"
            )
        return global_batch // per_step

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> TrainingConfig:
        """The ``training:`` section of ``path`` (missing: defaults), then non-None ``overrides``."""
        import yaml

        values = dict((yaml.safe_load(Path(path).read_text()) or {}).get("training", {}))
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown TrainingConfig fields: {unknown}")
        return cls(**values)


def _check_int(name: str, value: Any, *, optional: bool, minimum: int = 1) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        expected = "an int or None" if optional else "an int"
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")


__all__ = ["TrainingConfig"]
