#!/usr/bin/env python3
"""Hugging Face checkpoints in and out of moe_core training (Qwen3-MoE, Mixtral, OLMoE; local directories only).

    python tools/hf_checkpoint.py import HF_DIR OUT_DIR [--seq-length 4096]
        -> OUT_DIR/model.yaml (the model: section) and OUT_DIR/checkpoint (what pretrain --load reads)
    python tools/pretrain_gpt.py --config OUT_DIR/model.yaml --load OUT_DIR/checkpoint --finetune --save ft/ ...
    python tools/hf_checkpoint.py export --config OUT_DIR/model.yaml --load ft/ HF_OUT [--reference HF_DIR]

Import under torchrun with --expert-model-parallel-size reads on each rank only its experts; the checkpoint
records the model's config, so --load and --finetune refuse it under another architecture. Export writes
a directory that transformers' AutoModelForCausalLM.from_pretrained loads, after checking --config against
the checkpoint's recorded config; --reference (the same model's HF directory) keeps the original's token ids,
max_position_embeddings and non-weight files (tokenizer, generation config). Both build their output beside
OUT_DIR and rename it into place at the end; what each refuses: docs/hf_interop.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_core.config import TransformerConfig  # noqa: E402
from moe_core.interop.hf import build_empty_model, hf_config_file, load_hf_weights, save_hf  # noqa: E402
from moe_core.interop.hf_config import config_from_hf  # noqa: E402
from moe_core.interop.hf_files import (  # noqa: E402
    listing,
    publish_staged,
    read_json,
    staging_dir,
    start_staging,
    target_entries,
)
from moe_core.interop.hf_weights import hf_directory  # noqa: E402
from moe_core.models.gpt import GPTModel  # noqa: E402
from moe_core.parallel.launch import destroy_distributed, init_distributed  # noqa: E402
from moe_core.training.checkpoint import load_model_weights, save_checkpoint  # noqa: E402
from moe_core.training.checkpoint_files import LATEST, STATE, CheckpointError, resolve_checkpoint  # noqa: E402
from moe_core.training.config import TrainingConfig  # noqa: E402
from moe_core.training.schedule import build_scheduler  # noqa: E402
from moe_core.training.step import build_optimizer  # noqa: E402

MODEL_YAML = "model.yaml"
CHECKPOINT_DIR = "checkpoint"


def import_hf(hf_dir: str, out_dir: str, seq_length: int | None = None, expert_model_parallel_size: int = 1) -> Path:
    """Write ``out_dir/model.yaml`` and the DCP checkpoint ``out_dir/checkpoint`` (float32 weights, a fresh
    AdamW at step 0, the model's ``TransformerConfig`` recorded as ``save_checkpoint`` records it) of the HF
    checkpoint in ``hf_dir``. Collective under torchrun: each rank reads its experts.

    ``out_dir`` is built beside it and renamed into place at the end; an earlier import of the same ``hf_dir``
    there is replaced.

    Raises:
        FileExistsError: ``out_dir`` holds anything else (a training run's checkpoints, another import, other
            files), checked on every rank before anything is read.
        ValueError: a defect in the HF directory (``load_hf_weights``), raised on every rank.
    """
    out = Path(out_dir)
    _check_import_target(out, hf_dir)
    file = hf_config_file(hf_dir)
    config = config_from_hf(read_json(file), str(file))
    if seq_length is not None:
        config = dataclasses.replace(config, seq_length=seq_length)
    config = dataclasses.replace(config, expert_model_parallel_size=expert_model_parallel_size)
    pg = init_distributed(expert_model_parallel_size, num_moe_experts=config.num_moe_experts)
    rank0 = pg is None or dist.get_rank() == 0
    model = build_empty_model(config, pg)
    _on_every_rank(lambda: load_hf_weights(model, hf_dir, pg))
    training = TrainingConfig()
    optimizer = build_optimizer(model, training)
    scheduler = build_scheduler(optimizer, training.lr, training.min_lr, training.lr_warmup_iters,
                                training.train_iters)
    single = dataclasses.replace(config, expert_model_parallel_size=1)
    staging = start_staging(out) if rank0 else staging_dir(out)  # before rank 0's broadcast in save_checkpoint
    save_checkpoint(str(staging / CHECKPOINT_DIR), model, optimizer, scheduler, 0, pg, seed=training.seed,
                    model_config=single)

    def finish() -> None:
        if rank0:
            fields = dataclasses.asdict(single)
            (staging / MODEL_YAML).write_text(_import_header(hf_dir) + yaml.safe_dump({"model": fields},
                                                                                      sort_keys=False))
            publish_staged(staging, out)

    _on_every_rank(finish)
    return out


def _import_header(hf_dir: str) -> str:
    return f"# Imported from the Hugging Face checkpoint {hf_directory(hf_dir).resolve()} by tools/hf_checkpoint.py.\n"


def _check_import_target(out: Path, hf_dir: str) -> None:
    """Raise unless ``out`` is absent, empty, or an earlier import of ``hf_dir`` not trained into since."""
    held, saved = target_entries(out), target_entries(out / CHECKPOINT_DIR)
    runs = [name for name in held if name == LATEST or name.startswith("step_")] + [
        f"{CHECKPOINT_DIR}/{name}" for name in saved if name.startswith("step_") and name != "step_0"]
    if runs:
        raise FileExistsError(f"out_dir: {out} holds a training run's checkpoints ({listing(runs)}); an import "
                              "must not replace or mix with them: choose a new directory")
    yaml_file = out / MODEL_YAML
    earlier = (set(held) <= {MODEL_YAML, CHECKPOINT_DIR} and set(saved) <= {"step_0", LATEST} and yaml_file.is_file()
               and yaml_file.read_text(errors="replace").startswith(_import_header(hf_dir)))
    if held and not earlier:
        raise FileExistsError(f"out_dir: {out} holds {listing(held)}, not an earlier import of "
                              f"{hf_directory(hf_dir).resolve()}; choose a new or empty directory")


def _on_every_rank(fn) -> None:
    """``fn()`` on every rank; when it raises on any rank, every rank raises (one ``all_gather_object``), so
    no rank waits in a later collective for one that failed."""
    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, here or on every rank
        error = e
    if dist.is_initialized():
        messages: list = [None] * dist.get_world_size()
        dist.all_gather_object(messages, None if error is None else f"rank {dist.get_rank()}: {error}")
        failed = [m for m in messages if m is not None]
        if failed and error is None:
            raise RuntimeError(f"import: {'; '.join(failed)}")
    if error is not None:
        raise error


def export_hf(config_path: str, load: str, out_dir: str, reference: str | None = None,
              max_shard_size: str = "5GB", dtype: str | None = None, overwrite: bool = False) -> Path:
    """Load the model weights of the checkpoint ``load`` (one process) and write them as an HF directory
    (``save_hf``: written whole or not at all; ``reference`` must describe the same model).

    Raises:
        CheckpointError: the checkpoint records no model config, or another architecture than
            ``config_path`` (naming the fields).
    """
    config = TransformerConfig.from_yaml(config_path, expert_model_parallel_size=1)
    directory, _ = resolve_checkpoint(load)
    if not isinstance(read_json(directory / STATE).get("model_config"), dict):
        raise CheckpointError(f"load: {directory / STATE} records no model config, so --config cannot be checked "
                              "against the weights; import the Hugging Face checkpoint again with tools/"
                              "hf_checkpoint.py import, or save the weights from tools/pretrain_gpt.py: both "
                              "record it")
    model = GPTModel(config)
    load_model_weights(load, model, model_config=config)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    return save_hf(model, config, out_dir, max_shard_size=max_shard_size, reference=reference, overwrite=overwrite)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="HF directory -> model.yaml + DCP checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--seq-length", type=int, default=None,
                     help="training sequence length (default: the checkpoint's max_position_embeddings)")
    imp.add_argument("--expert-model-parallel-size", type=int, default=1)
    exp = commands.add_parser("export", help="moe_core checkpoint -> HF directory")
    exp.add_argument("out_dir")
    exp.add_argument("--config", required=True, help="the model.yaml of the run")
    exp.add_argument("--load", required=True, help="checkpoint directory (tools/pretrain_gpt.py --save)")
    exp.add_argument("--reference", default=None, help="the original HF directory (token ids, tokenizer files)")
    exp.add_argument("--max-shard-size", default="5GB")
    exp.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                     help="dtype of the written weights (default: float32, the training weights')")
    exp.add_argument("--overwrite", action="store_true", help="replace an earlier export in out_dir")
    args = parser.parse_args(argv)
    if args.command == "import":
        try:
            out = import_hf(args.hf_dir, args.out_dir, args.seq_length, args.expert_model_parallel_size)
        finally:
            if dist.is_initialized():
                destroy_distributed()
        print(f"wrote {out / MODEL_YAML} and {out / CHECKPOINT_DIR}; train with: python tools/pretrain_gpt.py "
              f"--config {out / MODEL_YAML} --load {out / CHECKPOINT_DIR} --finetune")
    else:
        out = export_hf(args.config, args.load, args.out_dir, args.reference, args.max_shard_size, args.dtype,
                        args.overwrite)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
