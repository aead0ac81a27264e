#!/usr/bin/env python3
"""Hugging Face checkpoints in and out of moe_core training (Qwen3-MoE, Mixtral, OLMoE; local directories only).

    python tools/hf_checkpoint.py import HF_DIR OUT_DIR [--seq-length 4096]
        -> OUT_DIR/model.yaml (the model: section) and OUT_DIR/checkpoint (what pretrain --load reads)
    python tools/pretrain_gpt.py --config OUT_DIR/model.yaml --load OUT_DIR/checkpoint --finetune --save ft/ ...
    python tools/hf_checkpoint.py export --config OUT_DIR/model.yaml --load ft/ HF_OUT [--reference HF_DIR]

Import under torchrun with --expert-model-parallel-size reads on each rank only its experts. Export writes
a directory that transformers' AutoModelForCausalLM.from_pretrained loads; --reference keeps the original's
token ids, max_position_embeddings and non-weight files (tokenizer, generation config).
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
from moe_core.interop.hf import build_empty_model, load_hf_weights, read_hf_config, save_hf  # noqa: E402
from moe_core.interop.hf_config import config_from_hf  # noqa: E402
from moe_core.models.gpt import GPTModel  # noqa: E402
from moe_core.parallel.launch import destroy_distributed, init_distributed  # noqa: E402
from moe_core.training.checkpoint import load_model_weights, save_checkpoint  # noqa: E402
from moe_core.training.config import TrainingConfig  # noqa: E402
from moe_core.training.schedule import build_scheduler  # noqa: E402
from moe_core.training.step import build_optimizer  # noqa: E402

MODEL_YAML = "model.yaml"
CHECKPOINT_DIR = "checkpoint"


def import_hf(hf_dir: str, out_dir: str, seq_length: int | None = None, expert_model_parallel_size: int = 1) -> Path:
    """Write ``out_dir/model.yaml`` and the DCP checkpoint ``out_dir/checkpoint`` (float32 weights, a fresh
    AdamW at step 0) of the HF checkpoint in ``hf_dir``. Collective under torchrun: each rank reads its experts.
    """
    config = config_from_hf(read_hf_config(hf_dir))
    if seq_length is not None:
        config = dataclasses.replace(config, seq_length=seq_length)
    config = dataclasses.replace(config, expert_model_parallel_size=expert_model_parallel_size)
    pg = init_distributed(expert_model_parallel_size, num_moe_experts=config.num_moe_experts)
    model = build_empty_model(config, pg)
    load_hf_weights(model, hf_dir, pg)
    training = TrainingConfig()
    optimizer = build_optimizer(model, training)
    scheduler = build_scheduler(optimizer, training.lr, training.min_lr, training.lr_warmup_iters,
                                training.train_iters)
    out = Path(out_dir)
    save_checkpoint(str(out / CHECKPOINT_DIR), model, optimizer, scheduler, 0, pg, seed=training.seed)
    if pg is None or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        fields = dataclasses.asdict(dataclasses.replace(config, expert_model_parallel_size=1))
        header = f"# Imported from the Hugging Face checkpoint {Path(hf_dir).resolve()} by tools/hf_checkpoint.py.\n"
        (out / MODEL_YAML).write_text(header + yaml.safe_dump({"model": fields}, sort_keys=False))
    return out


def export_hf(config_path: str, load: str, out_dir: str, reference: str | None = None,
              max_shard_size: str = "5GB", dtype: str | None = None, overwrite: bool = False) -> Path:
    """Load the model weights of the checkpoint ``load`` (one process) and write them as an HF directory
    (``save_hf``: written whole or not at all; ``reference`` must describe the same model)."""
    config = TransformerConfig.from_yaml(config_path, expert_model_parallel_size=1)
    model = GPTModel(config)
    load_model_weights(load, model)
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
