"""TrainingConfig: the ``training:`` section of a run's YAML (Megatron's argument names)."""

from __future__ import annotations

import codecs
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_core.config import INT64_MAX, check_field_types, check_number, load_config_section
from moe_core.training.blend import parse_split

DECODE_ERRORS = ("strict", "replace", "ignore", "backslashreplace")


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
    """Checkpoint directory: each checkpoint goes to save/step_<N>/, written at the end and every save_interval
    (``moe_core.training.checkpoint``); checked for writability at start-up."""
    save_interval: int | None = None
    """Steps between checkpoints; None: only at the end."""
    save_keep: int = 2
    """Checkpoints kept in ``save`` (those of the highest steps); older ones are deleted after each save."""
    load: str | None = None
    """Checkpoint to resume from: a ``save`` directory (its latest complete checkpoint) or one step_<N>/
    directory (same seed and schedule: the run continues the saved trajectory)."""
    load_partial: bool = False
    """Load only the model weights whose names and shapes match, even from another architecture; the optimizer,
    schedule, RNG and step start afresh (step 0)."""
    max_skipped_steps: int = 10
    """Steps skipped for a non-finite loss or gradient norm after which the run stops with an error."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of every collective (Megatron's --distributed-timeout-minutes): a stuck or stopped rank makes
    the others fail with an error instead of hanging."""
    finetune: bool = False
    """With ``load``: take the model's weights only and start at step 0 with a fresh optimizer and schedule
    (Megatron's --finetune; e.g. from ``tools/hf_checkpoint.py import``). The architecture must match."""
    exit_interval: int | None = None
    """Stop (evaluate, save) after the first step that is a multiple of this; the LR schedule still spans
    train_iters, so a later --load continues the same run (Megatron's --exit-interval)."""
    seed: int = 1234
    """Seed of the initialisation and of every batch (batches are a function of seed and step)."""
    data_path: list[str] | None = None
    """Text or JSONL files; or Megatron indexed datasets, as prefixes of ``.bin`` / ``.idx`` files, optionally
    weighted (``[0.3, a, 0.7, b]`` as strings: a blend); with ``sft``, chat JSONL files; None: the Python standard
    library's .py sources."""
    split: str | None = None
    """Megatron's --split of indexed datasets and SFT data: train, validation, test weights (``"969,30,1"``, the
    default), cutting each dataset's documents in file order. A text corpus splits by file name instead."""
    reset_position_ids: bool = False
    """RoPE positions restart after every EOD token (Megatron's --reset-position-ids; indexed data)."""
    reset_attention_mask: bool = False
    """Attention never crosses an EOD token (Megatron's --reset-attention-mask; indexed data)."""
    eod_mask_loss: bool = False
    """No loss where the input is an EOD token (Megatron's --eod-mask-loss; indexed data). The loss is then the
    mean over the tokens that count, over the global batch."""
    sft: bool = False
    """Supervised fine-tuning: data_path holds chat JSONL, rendered by the tokenizer's chat template, trained on
    the assistant turns only and packed with document masks (``moe_core.training.sft``)."""
    data_encoding: str = "utf-8"
    """Codec of the data files, optionally ``codec:errors`` (PYTHONIOENCODING's form) with errors one of
    DECODE_ERRORS; plain ``codec`` decodes strictly: an undecodable byte is an error naming file and line."""
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
    enable_cuda_graph: bool | None = None
    """None: on where it applies (``training.fast_path``). Replay each compiled layer's forward and backward as CUDA
    graphs (torch.compile's ``reduce-overhead``
    mode; Megatron's --enable-cuda-graph): the host no longer issues every kernel, which pays where the host
    sets the pace (EP's extra ops, small layers). Needs ``compile``, static shapes (under EP the sync-free
    exchange, ``moe_dispatch_sync_free``) and parameters at fixed addresses: one process, or DDP with the experts
    alone on their expert-DP mesh and no tensor parallelism; not FSDP2, which allocates parameters anew every
    step. Each
    micro-batch of a step records and replays graphs of its own (a path of torch's graph tree each, as the earlier
    micro-batches' gradients stay alive until the step ends). On CPU the layers run compiled, without graphs."""

    def __post_init__(self) -> None:
        if isinstance(self.data_path, str):
            self.data_path = [self.data_path]
        check_field_types(self)
        for name in ("micro_batch_size", "train_iters", "log_interval", "eval_iters", "global_batch_size",
                     "eval_interval", "save_interval", "exit_interval", "save_keep"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "lr_warmup_iters", "max_skipped_steps"):
            _check_int(name, getattr(self, name), minimum=0)
        self._check_floats()
        if self.min_lr > self.lr:
            raise ValueError(
                f"lr, min_lr: expected 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}"
            )
        if self.lr_warmup_iters > self.train_iters:
            raise ValueError(
                f"lr_warmup_iters: expected 0..train_iters ({self.train_iters}), got {self.lr_warmup_iters}"
            )
        if self.enable_cuda_graph and (not self.compile or self.use_torch_fsdp2):
            raise ValueError(f"enable_cuda_graph: needs compile and no use_torch_fsdp2 (FSDP2 allocates parameters "
                             f"anew every step), got compile={self.compile}, use_torch_fsdp2={self.use_torch_fsdp2}")
        if self.sft and not self.data_path:
            raise ValueError("sft: expected chat JSONL files (data_path), got data_path=None")
        if self.split is not None:
            parse_split(self.split)
        if self.finetune and not self.load:
            raise ValueError("finetune: expected a checkpoint to take the weights from (load), got load=None")
        self.decode_args()

    def _check_floats(self) -> None:
        """Every float finite and in its range (NaN would, e.g., silently turn clipping off)."""
        positive = {"low": 0.0, "low_open": True}
        non_negative = {"low": 0.0}
        beta = {"low": 0.0, "high": 1.0, "high_open": True}
        ranges = {"lr": positive, "min_lr": non_negative, "weight_decay": non_negative, "adam_beta1": beta,
                  "adam_beta2": beta, "adam_eps": positive, "clip_grad": non_negative,
                  "distributed_timeout_minutes": positive}
        for name, bounds in ranges.items():
            setattr(self, name, check_number(name, getattr(self, name), **bounds))

    def decode_args(self) -> tuple[str, str]:
        """``(codec, errors)`` of ``data_encoding``, for ``bytes.decode``.

        Raises:
            ValueError: an unknown codec or an errors policy not in DECODE_ERRORS.
        """
        codec, _, errors = self.data_encoding.partition(":")
        errors = errors or "strict"
        try:
            codecs.lookup(codec)
        except LookupError:
            raise ValueError(f"data_encoding: unknown codec {codec!r} in {self.data_encoding!r}") from None
        if errors not in DECODE_ERRORS:
            raise ValueError(f"data_encoding: expected 'codec' or 'codec:errors' with errors one of {DECODE_ERRORS}, "
                             f"got {self.data_encoding!r}")
        return codec, errors

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
        """The ``training:`` section of the run YAML ``path`` (``load_config_section``; missing: defaults), then
        non-None ``overrides``."""
        values = dict(load_config_section(path, "training"))
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown TrainingConfig fields: {unknown}")
        return cls(**values)


def _check_int(name: str, value: int | None, *, minimum: int = 1) -> None:
    """Range of an int field (None passes: check_field_types allowed it)."""
    if value is not None and not minimum <= value <= INT64_MAX:
        raise ValueError(f"{name}: expected an int >= {minimum} and <= 2**63 - 1, got {value}")


__all__ = ["TrainingConfig"]
