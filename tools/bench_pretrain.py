"""Training throughput on one GPU: moe_core's trainer against a plain-PyTorch trainer of the same model.

    python3 tools/bench_pretrain.py --json pretrain.json                     # configs/gpu_a.yaml, gpu_b.yaml
    python3 tools/bench_pretrain.py --configs configs/gpu_a.yaml --profile   # + CUDA time by kernel category
    python3 tools/bench_pretrain.py --smoke --json smoke.json                # a tiny model, a few steps (the CI test)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --standalone --nproc-per-node 2 tools/bench_pretrain.py --json $OUT/pretrain_ep2.json   # EP = 2 vs 1 GPU

Providers: ``moe_core``, ``setup_training`` + ``train_step`` of moe_core.training.step with the YAML's
``training:`` section and ``compile`` off; ``moe_core_compiled``, the same with ``compile: true`` (each layer
compiled); ``native``, the plain-PyTorch GPT of tools/_native_gpt.py (RMSNorm, RoPE, SDPA causal attention,
the torch-native MoE of tools/_native_moe.py, fused AdamW, gradient clipping, bf16 autocast over fp32
weights) starting from the weights moe_core's ``build_model`` gives; ``native_compiled``, each block compiled.
Every step trains on one fixed random batch of ``micro_batch_size`` sequences. ``--enable-cuda-graph``: both compiled
providers replay their layers as CUDA graphs (torch.compile's ``reduce-overhead`` mode per layer).

Per provider: ``--warmup`` steps (compilation happens there), then ``--steps`` steps timed with CUDA events (median,
10-90 percentile spread); tokens/s over the median step; peak memory (weights, AdamW states and activations:
``torch.cuda.max_memory_allocated`` above what was allocated before the provider was built); the first and last loss.
MFU is the trainer's: ``GPTModel.flops_per_token()`` (PaLM: 6 N_active + 12 L Nq D S) times tokens/s over the bf16 peak
in moe_core.training.trainer's ``PEAK_BF16_TFLOPS`` (``mfu()``); ``mfu_causal`` counts half the attention term (6 L Nq D
S: the causal mask skips half of Q K^T and A V), the convention of the TRL Qwen3-MoE report (Llama 2/3's);
``megatron_tflops_per_gpu`` is model TFLOP/s per GPU by Megatron-LM's count (``moe_core.models.flops``), the figure
Megatron's published recipes quote. ``--profile``: torch.profiler over 3 steps of each provider, CUDA time by category
(attention, GEMM, optimizer incl. gradient clipping, rest; name patterns in tools/_bench_common.py) and the top 10
kernels.

Under torchrun (``WORLD_SIZE`` > 1; NCCL on GPUs, gloo on CPU): expert parallelism over all ranks. Providers
``moe_core`` and ``moe_core_compiled`` only (the native trainer has no EP). Each runs twice per config: with
``ep`` = the world size (``setup_training`` with the process groups: DDP, every rank a data-parallel rank with its
own ``micro_batch_size`` sequences, the experts split), then with ``ep`` = 1, the same config on every rank's own
GPU at once, no communication (the one-GPU baseline). ``tokens_per_s`` is per GPU (a rank's tokens per step over
the slowest rank's median step); ``vs_one_gpu`` is the EP row's over the baseline's; peak memory is the largest
rank's; losses are rank 0's (the EP step's loss is the global batch's). ``ep_load_imbalance``: the last step's
rows on the busiest EP rank over the mean (``moe_core.moe.metrics.ep_load_imbalance``), 1.0 when balanced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _native_gpt  # noqa: E402
from _bench_common import (  # noqa: E402
    ATTENTION,
    GEMM,
    OPTIMIZER,
    breakdown,
    error_message,
    fmt,
    free_memory,
    kernel_times,
    ratio,
    run_metadata,
    single_thread,
    timed,
)
from _bench_common import print_table as print_rows  # noqa: E402
from _bench_dist import slowest_rank  # noqa: E402

from moe_core import TransformerConfig  # noqa: E402
from moe_core.config import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, RECOMPUTE_MODULES  # noqa: E402
from moe_core.models.flops import megatron_flops_per_token  # noqa: E402
from moe_core.models.gpt import GPTModel  # noqa: E402
from moe_core.moe.metrics import routing_report  # noqa: E402
from moe_core.parallel.launch import destroy_distributed, init_distributed  # noqa: E402
from moe_core.training.config import TrainingConfig  # noqa: E402
from moe_core.training.fast_path import resolve_fast_path  # noqa: E402
from moe_core.training.step import build_model, setup_training, train_step, training_device  # noqa: E402
from moe_core.training.trainer import mfu  # noqa: E402

CONFIGS = [str(Path(__file__).resolve().parents[1] / "configs" / name) for name in ("gpu_a.yaml", "gpu_b.yaml")]
PROVIDERS = ("moe_core", "moe_core_compiled", "native", "native_compiled")
SMOKE_PROVIDERS = ("moe_core", "native")  # compiling with inductor on CPU takes minutes
EP_PROVIDERS = ("moe_core", "moe_core_compiled")
RECOMPUTE_ARGS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
# Attention first: cuDNN's flash kernels carry "wgmma" in their names, xformers' fmha ones "cutlass".
CATEGORIES = {"attention": ATTENTION, "gemm": GEMM, "optimizer": OPTIMIZER}


def smoke_configs() -> tuple[TransformerConfig, TrainingConfig]:
    model = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2, num_moe_experts=4,
                              moe_router_topk=2, moe_ffn_hidden_size=16, seq_length=16)
    # min_lr = lr: a constant LR, as the native trainer's, so both train one trajectory.
    return model, TrainingConfig(micro_batch_size=2, train_iters=100, lr=1e-3, min_lr=1e-3)


def flop_counts(model_config: TransformerConfig) -> dict:
    """Parameters and FLOPs per token of the config's ``GPTModel`` (built on the meta device)."""
    with torch.device("meta"):
        gpt = GPTModel(model_config)
    palm = gpt.flops_per_token()
    cfg = model_config
    causal = palm - 6 * cfg.num_layers * cfg.num_attention_heads * cfg.kv_channels * cfg.seq_length
    return dict(params=gpt.num_parameters(), active_params=gpt.num_parameters(active=True),
                flops_per_token=palm, flops_per_token_causal=causal,
                flops_per_token_megatron=megatron_flops_per_token(model_config))


def build_step(provider: str, model_config: TransformerConfig, training: TrainingConfig, inputs, labels, pg=None,
               cuda_graph: bool | None = None):
    """``(step, device, model, path)``: ``step()`` runs one training step and returns its loss (a 0-dim tensor);
    ``model`` the moe_core GPTModel (None for the native trainer); ``path`` the execution path taken
    (``moe_dispatch_sync_free``, ``enable_cuda_graph``). ``pg``: EP over its groups (moe_core providers only).
    ``cuda_graph``: compiled providers replay their layers as CUDA graphs; None: moe_core's providers take the
    trainer's default (``training.fast_path``), the native trainer none."""
    compiled = provider.endswith("_compiled")
    if cuda_graph is not None:
        cuda_graph = cuda_graph and compiled
    if provider.startswith("moe_core"):
        if pg is not None:
            model_config = dataclasses.replace(model_config, expert_model_parallel_size=pg.ep_size)
        training = dataclasses.replace(training, compile=compiled, enable_cuda_graph=cuda_graph)
        model_config, training, _ = resolve_fast_path(model_config, training, pg, training_device(pg))
        state = setup_training(model_config, training, pg)
        path = dict(moe_dispatch_sync_free=model_config.moe_dispatch_sync_free,
                    enable_cuda_graph=training.enable_cuda_graph)
        return (lambda: train_step(state, inputs, labels)[0]), state.device, state.model, path
    cuda_graph = bool(cuda_graph)
    device = training_device(None)
    gpt = build_model(model_config, training, device)
    model = _native_gpt.NativeGPT.from_gpt(gpt)
    del gpt
    if compiled:
        for block in model.layers:
            block.compile(mode="reduce-overhead" if cuda_graph else None)
    optimizer = _native_gpt.build_adamw(model, training.lr, (training.adam_beta1, training.adam_beta2),
                                        training.adam_eps, training.weight_decay)
    max_norm = training.clip_grad if training.clip_grad > 0 else float("inf")

    def step():
        if cuda_graph:
            torch.compiler.cudagraph_mark_step_begin()
        return _native_gpt.train_step(model, optimizer, inputs, labels, training.micro_batch_size, max_norm,
                                      training.bf16)

    return step, device, None, dict(enable_cuda_graph=cuda_graph)


def bench_provider(provider: str, model_config: TransformerConfig, training: TrainingConfig, counts: dict,
                   args, pg=None) -> dict:
    """One provider's row; with ``pg`` under EP (collective: every rank calls it), else alone on this device."""
    rank = 0 if pg is None else dist.get_rank()
    gen = torch.Generator().manual_seed(training.seed + rank)
    shape = (training.micro_batch_size * training.num_micro_batches(dp_size=1 if pg is None else pg.dp_size),
             model_config.seq_length)
    inputs = torch.randint(0, model_config.vocab_size, shape, generator=gen)
    labels = torch.randint(0, model_config.vocab_size, shape, generator=gen)
    device = training_device(pg)
    before = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    step, device, model, path = build_step(provider, model_config, training, inputs.to(device), labels.to(device),
                                           pg, args.enable_cuda_graph)
    first_loss = step().item()
    row = timed(step, args.steps, max(args.warmup - 1, 0), device)
    last_loss = step().item()
    if pg is not None and pg.ep_size > 1:  # the last step's loads
        row["ep_load_imbalance"] = routing_report(model.moe_layers(), pg).ep_load_imbalance
    peak_gib = (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else None
    if dist.is_initialized():  # the slowest rank's step, the largest rank's memory
        row["median_ms"], peak = slowest_rank([row["median_ms"], peak_gib or 0.0], device)
        peak_gib = peak if device.type == "cuda" else None
    tokens_per_s = inputs.numel() / (row["median_ms"] / 1e3)
    row.update(first_loss=first_loss, last_loss=last_loss, tokens_per_step=inputs.numel(), tokens_per_s=tokens_per_s,
               mfu=mfu(counts["flops_per_token"], tokens_per_s, device),
               mfu_causal=mfu(counts["flops_per_token_causal"], tokens_per_s, device), peak_gib=peak_gib,
               megatron_tflops_per_gpu=counts["flops_per_token_megatron"] * tokens_per_s / 1e12,
               ep=1 if pg is None else pg.ep_size, **path)
    if args.profile:
        split = breakdown(kernel_times(step, 3, device), CATEGORIES)
        row["profile"] = dict(ms_per_step=split["ms"], total_ms=split["total_ms"], top=split["ranked"][:10])
        if rank == 0:
            print_profile(provider, split, "CUDA" if device.type == "cuda" else "CPU op self")
    return row


def print_profile(provider: str, split: dict, kind: str) -> None:
    total = split["total_ms"] or 1.0
    print(f"{provider}: {kind} time per step {split['total_ms']:.2f} ms: " + ", ".join(
        f"{name} {ms:.2f} ms ({100 * ms / total:.1f}%)" for name, ms in split["ms"].items()))
    for k in split["ranked"][:10]:
        print(f"  {k['ms']:8.3f} ms  {k['category']:9s}  {k['name'][:110]}")


def print_table(rows: list[dict]) -> None:
    def pct(fraction):
        return None if fraction is None else 100 * fraction

    print_rows(rows, [("config", 10), ("provider", 18)], [
        ("EP", 3, lambda r: str(r.get("ep", 1))),
        ("step ms", 9, lambda r: f"{r['median_ms']:.2f}"), ("spread", 7, lambda r: f"{100 * r['spread']:.1f}%"),
        ("tokens/s", 10, lambda r: f"{r['tokens_per_s']:.0f}"), ("MFU %", 7, lambda r: fmt(pct(r["mfu"]), ".1f")),
        ("causal %", 8, lambda r: fmt(pct(r["mfu_causal"]), ".1f")),
        ("TFLOP/s", 7, lambda r: f"{r['megatron_tflops_per_gpu']:.1f}"),
        ("peak GiB", 8, lambda r: fmt(r["peak_gib"], ".2f")),
        ("loss first", 10, lambda r: f"{r['first_loss']:.3f}"), ("last", 7, lambda r: f"{r['last_loss']:.3f}"),
        ("vs 1 GPU", 8, lambda r: fmt(r.get("vs_one_gpu"), ".2f")),
        ("EP load", 7, lambda r: fmt(r.get("ep_load_imbalance"), ".2f")),
        ("path", 14, lambda r: "+".join(k for k, on in (("sync-free", r.get("moe_dispatch_sync_free")),
                                                        ("graphs", r.get("enable_cuda_graph"))) if on) or "-"),
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="YAMLs with model: and training: sections")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS,
                        help="default: all; --smoke: the eager ones; under torchrun: the moe_core ones")
    parser.add_argument("--steps", type=int, help="timed steps (default 10; --smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first, compilation included (default 3; --smoke 1)")
    parser.add_argument("--profile", action="store_true", help="CUDA time by category over 3 steps per provider")
    parser.add_argument("--smoke", action="store_true", help="a tiny built-in model instead of --configs")
    parser.add_argument("--moe-dispatch-sync-free", action=argparse.BooleanOptionalAction,
                        help="the EP rows dispatch without a host sync (moe_dispatch_sync_free; default: the "
                             "trainer's choice, training.fast_path)")
    parser.add_argument("--enable-cuda-graph", action=argparse.BooleanOptionalAction,
                        help="the compiled providers replay each layer as CUDA graphs (torch.compile's "
                             "reduce-overhead; TrainingConfig.enable_cuda_graph; default: moe_core's the trainer's "
                             "choice, the native trainer's off)")
    parser.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES,
                        help="activation recompute (TransformerConfig.recompute_*; Megatron's flags)")
    parser.add_argument("--recompute-method", choices=RECOMPUTE_METHODS)
    parser.add_argument("--recompute-num-layers", type=int)
    parser.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.providers is None and distributed:
        args.providers = ["moe_core"] if args.smoke else list(EP_PROVIDERS)
    elif args.providers is None:
        args.providers = list(SMOKE_PROVIDERS if args.smoke else PROVIDERS)
    if distributed and set(args.providers) - set(EP_PROVIDERS):
        parser.error(f"--providers: under torchrun only {EP_PROVIDERS} (the native trainer has no EP)")
    args.steps = args.steps or (2 if args.smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    return args


def run(args, pg=None) -> list[dict]:
    """Every row; with ``pg`` (EP over all ranks, collective) each provider under EP, then alone on every rank."""
    runs = {"smoke": smoke_configs()} if args.smoke else {
        Path(path).stem: (TransformerConfig.from_yaml(path, moe_dispatch_sync_free=args.moe_dispatch_sync_free,
                                                      **{k: getattr(args, k) for k in RECOMPUTE_ARGS}),
                          TrainingConfig.from_yaml(path)) for path in args.configs}
    layouts = [None] if pg is None else [pg, None]
    rows = []
    with single_thread(args.smoke):
        for name, (model_config, training) in runs.items():
            counts = flop_counts(model_config)
            for provider in args.providers:
                for layout in layouts:
                    row = dict(config=name, provider=provider, **counts)
                    try:
                        row.update(bench_provider(provider, model_config, training, counts, args, layout))
                    except Exception as err:  # noqa: BLE001  (compile failure, OOM: recorded, the others go on)
                        row["error"] = error_message(err)
                        print(f"  {name} {provider}: {row['error']}", file=sys.stderr, flush=True)
                    rows.append(row)
                    torch._dynamo.reset()
                    free_memory()
                if pg is not None:
                    ep_row, one_gpu = rows[-2:]
                    ep_row["vs_one_gpu"] = ratio(ep_row.get("tokens_per_s"), one_gpu.get("tokens_per_s"))
            if pg is None or dist.get_rank() == 0:
                print(f"done {name}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_pretrain: needs a CUDA device (or --smoke)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pg = init_distributed(world) if world > 1 else None
    try:
        rows = run(args, pg)
        if pg is None or dist.get_rank() == 0:
            print_table(rows)
            if args.json:
                meta = dict(run_metadata(training_device(pg)), world_size=world, args=vars(args))
                Path(args.json).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    finally:
        if pg is not None:
            destroy_distributed()
    return rows


if __name__ == "__main__":
    main()
