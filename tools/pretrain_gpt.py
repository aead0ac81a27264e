#!/usr/bin/env python3
"""Pretrain a Megatron-style MoE GPT.

    python tools/pretrain_gpt.py --config configs/tiny.yaml [--train-iters 500 --lr 2e-3 ...]
    torchrun --nproc-per-node 2 tools/pretrain_gpt.py --expert-model-parallel-size 2 [--use-torch-fsdp2]
    torchrun --nproc-per-node 4 tools/pretrain_gpt.py --tensor-model-parallel-size 2 --sequence-parallel \
        --expert-model-parallel-size 2

Under torchrun the processes form TP groups of --tensor-model-parallel-size ranks (with --sequence-parallel,
which TP requires), each TP group one data-parallel rank; --expert-model-parallel-size splits the experts over
that many ranks and --expert-tensor-parallel-size (1 or the TP size, default the TP size) each expert's
fc1 / fc2 (gloo on CPU, NCCL on GPUs; MOE_CORE_BACKEND overrides), DDP unless --use-torch-fsdp2.

Flags use Megatron's spellings and override the YAML's ``model:`` (TransformerConfig) and ``training:``
(TrainingConfig) fields. The default corpus is the Python standard library's sources, tokenized as bytes.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_core.config import RECOMPUTE_MODULES, TransformerConfig  # noqa: E402
from moe_core.parallel.launch import destroy_distributed, init_distributed  # noqa: E402
from moe_core.training.config import TrainingConfig  # noqa: E402
from moe_core.training.tokenizer import build_tokenizer  # noqa: E402
from moe_core.training.trainer import TrainingDivergedError, pretrain  # noqa: E402

# (flag, field, type); the field's section is found by name.
MODEL_FLAGS = [
    ("--num-layers", "num_layers", int), ("--hidden-size", "hidden_size", int),
    ("--num-attention-heads", "num_attention_heads", int), ("--num-query-groups", "num_query_groups", int),
    ("--ffn-hidden-size", "ffn_hidden_size", int), ("--seq-length", "seq_length", int),
    ("--num-experts", "num_moe_experts", int), ("--moe-router-topk", "moe_router_topk", int),
    ("--moe-ffn-hidden-size", "moe_ffn_hidden_size", int), ("--moe-aux-loss-coeff", "moe_aux_loss_coeff", float),
    ("--moe-z-loss-coeff", "moe_z_loss_coeff", float), ("--moe-input-jitter-eps", "moe_input_jitter_eps", float),
    ("--moe-router-bias-update-rate", "moe_router_bias_update_rate", float),
    ("--moe-router-load-balancing-type", "moe_router_load_balancing_type", str),
    ("--moe-router-score-function", "moe_router_score_function", str),
    ("--moe-expert-capacity-factor", "moe_expert_capacity_factor", float),
    ("--moe-token-dispatcher-type", "moe_token_dispatcher_type", str),
    ("--expert-model-parallel-size", "expert_model_parallel_size", int),
    ("--tensor-model-parallel-size", "tensor_model_parallel_size", int),
    ("--expert-tensor-parallel-size", "expert_tensor_parallel_size", int),
    ("--cross-entropy-chunk-size", "cross_entropy_chunk_size", int),
    ("--recompute-granularity", "recompute_granularity", str), ("--recompute-method", "recompute_method", str),
    ("--recompute-num-layers", "recompute_num_layers", int),
]
TRAINING_FLAGS = [
    ("--micro-batch-size", "micro_batch_size", int), ("--global-batch-size", "global_batch_size", int),
    ("--train-iters", "train_iters", int), ("--lr", "lr", float), ("--min-lr", "min_lr", float),
    ("--lr-warmup-iters", "lr_warmup_iters", int), ("--weight-decay", "weight_decay", float),
    ("--adam-beta1", "adam_beta1", float), ("--adam-beta2", "adam_beta2", float), ("--adam-eps", "adam_eps", float),
    ("--clip-grad", "clip_grad", float), ("--log-interval", "log_interval", int),
    ("--eval-interval", "eval_interval", int), ("--eval-iters", "eval_iters", int), ("--save", "save", str),
    ("--save-interval", "save_interval", int), ("--save-keep", "save_keep", int), ("--load", "load", str),
    ("--exit-interval", "exit_interval", int), ("--max-skipped-steps", "max_skipped_steps", int),
    ("--distributed-timeout-minutes", "distributed_timeout_minutes", float),
    ("--data-encoding", "data_encoding", str), ("--split", "split", str),
    ("--seed", "seed", int), ("--tokenizer", "tokenizer", str), ("--output-dir", "output_dir", str),
    ("--tensorboard-dir", "tensorboard_dir", str),
]


def parse_args(argv: list[str] | None = None) -> tuple[TransformerConfig, TrainingConfig]:
    """Parse flags into the two configs (flags beat the YAML)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"),
                        help="YAML with model: and training: sections")
    for flag, field, kind in MODEL_FLAGS + TRAINING_FLAGS:
        parser.add_argument(flag, dest=field, type=kind, default=None)
    parser.add_argument("--data-path", dest="data_path", nargs="+", default=None,
                        help="text or JSONL files; indexed-dataset prefixes, optionally weighted (0.3 a 0.7 b); "
                             "with --sft, chat JSONL files")
    for flag, help_text in (("--reset-position-ids", "RoPE positions restart after each EOD token"),
                            ("--reset-attention-mask", "attention never crosses an EOD token"),
                            ("--eod-mask-loss", "no loss where the input is an EOD token"),
                            ("--sft", "fine-tune on chat JSONL: assistant turns only, packed, document-masked")):
        parser.add_argument(flag, dest=flag[2:].replace("-", "_"), action="store_true", default=None, help=help_text)
    parser.add_argument("--bf16", dest="bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 on CUDA (default on): autocast, or FSDP2's MixedPrecisionPolicy with "
                             "--use-torch-fsdp2")
    parser.add_argument("--use-torch-fsdp2", dest="use_torch_fsdp2", action="store_true", default=None)
    parser.add_argument("--finetune", dest="finetune", action="store_true", default=None,
                        help="with --load: the model's weights only; fresh optimizer, schedule and step "
                             "(the config's vocab_size stays, --tokenizer must fit in it)")
    parser.add_argument("--load-partial", dest="load_partial", action="store_true", default=None,
                        help="load only the matching weights of --load, even from another architecture; start at "
                             "step 0 with a fresh optimizer")
    parser.add_argument("--compile", dest="compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each transformer layer")
    parser.add_argument("--enable-cuda-graph", dest="enable_cuda_graph", action=argparse.BooleanOptionalAction,
                        default=None, help="with --compile: replay each layer as CUDA graphs (one process, or DDP "
                                           "without TP, with one rank per expert-DP mesh and, under EP, "
                                           "--moe-dispatch-sync-free); default: on where it applies")
    parser.add_argument("--moe-grouped-gemm", dest="moe_grouped_gemm", action=argparse.BooleanOptionalAction,
                        default=None, help="GroupedMLP (default) or, with --no-moe-grouped-gemm, SequentialMLP")
    parser.add_argument("--moe-router-enable-expert-bias", dest="moe_router_enable_expert_bias",
                        action="store_true", default=None, help="aux-loss-free balancing (DeepSeek-V3)")
    parser.add_argument("--moe-dispatch-sync-free", dest="moe_dispatch_sync_free",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="EP dispatch without a host sync (static, worst-case expert rows); default: on where it "
                             "applies (moe_core.training.fast_path)")
    parser.add_argument("--moe-shared-expert-overlap", dest="moe_shared_expert_overlap",
                        action=argparse.BooleanOptionalAction, default=None,
                        help="the shared expert on a side stream during the EP exchange; default: on where it applies")
    parser.add_argument("--recompute-modules", dest="recompute_modules", nargs="+", choices=RECOMPUTE_MODULES,
                        default=None, help="with --recompute-granularity selective (default: core_attn)")
    parser.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_true", default=None,
                        help="split the sequence over the TP ranks (required with --tensor-model-parallel-size > 1)")
    args = vars(parser.parse_args(argv))
    model_overrides = {field: args[field] for _, field, _ in MODEL_FLAGS}
    model_overrides.update(moe_grouped_gemm=args["moe_grouped_gemm"],
                           moe_router_enable_expert_bias=args["moe_router_enable_expert_bias"],
                           moe_dispatch_sync_free=args["moe_dispatch_sync_free"],
                           moe_shared_expert_overlap=args["moe_shared_expert_overlap"],
                           recompute_modules=args["recompute_modules"],
                           sequence_parallel=args["sequence_parallel"])
    training_overrides = {field: args[field] for _, field, _ in TRAINING_FLAGS}
    training_overrides.update(data_path=args["data_path"], bf16=args["bf16"], use_torch_fsdp2=args["use_torch_fsdp2"],
                              compile=args["compile"], enable_cuda_graph=args["enable_cuda_graph"],
                              finetune=args["finetune"],
                              load_partial=args["load_partial"],
                              **{k: args[k] for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss",
                                                      "sft")})
    # A fine-tuned checkpoint fixes the vocabulary (the model's may be padded past the tokenizer's).
    if args["tokenizer"] is not None and not args["finetune"]:
        model_overrides["vocab_size"] = build_tokenizer(args["tokenizer"]).vocab_size
    model = TransformerConfig.from_yaml(args["config"], **model_overrides)
    training = TrainingConfig.from_yaml(args["config"], **training_overrides)
    return model, training


def main(argv: list[str] | None = None) -> None:
    """Parse, initialise the ranks, pretrain. A configuration error, or a diverged run, exits with status 1 and its
    reason on stderr (a configuration error without a traceback: the message names the field and what came)."""
    try:
        model_config, training_config = parse_args(argv)
    except (ValueError, TypeError) as e:
        sys.exit(f"pretrain_gpt.py: error: {e}")
    timeout = datetime.timedelta(minutes=training_config.distributed_timeout_minutes)
    pg = init_distributed(model_config.expert_model_parallel_size,
                          tensor_model_parallel_size=model_config.tensor_model_parallel_size,
                          expert_tensor_parallel_size=model_config.expert_tensor_parallel_size,
                          num_moe_experts=model_config.num_moe_experts, timeout=timeout)
    try:
        pretrain(model_config, training_config, pg_collection=pg)
    except TrainingDivergedError as e:
        sys.exit(f"pretrain_gpt.py: {e}")
    finally:
        if pg is not None:
            destroy_distributed()


if __name__ == "__main__":
    main()
