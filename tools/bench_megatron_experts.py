"""Benchmark Megatron-Core's experts on dispatched rows: moe_core's experts against Megatron's ``SequentialMLP``.

    python3 tools/bench_megatron_experts.py --json megatron_experts.json     # Qwen3-30B-A3B, 4096 and 16384 tokens
    python3 tools/bench_megatron_experts.py --shapes qwen3_30b_a3b_16k --counts-on-device
    python3 tools/bench_megatron_experts.py --smoke --json smoke.json        # CPU, a tiny shape (the CI test)

Needs megatron-core (no TransformerEngine). Providers, all built by Megatron-Core's own constructors in one process
(Megatron's parallel state over a one-rank group) and loaded with the same weights: ``sequential``, Megatron's
``SequentialMLP`` (a GEMM pair per expert: the experts Megatron runs without TransformerEngine); ``moe_core``,
``MoECoreGroupedMLP``; ``te_grouped_mlp``, Megatron's ``TEGroupedMLP`` on moe_core's grouped linears (the builder
protocols). The layer is Qwen3-30B-A3B's: hidden 2048, 128 experts (EP = 1: all local), top-8, SwiGLU experts of
width 768, no bias, bf16. The rows are T * 8 random bf16 rows grouped by expert, their counts from a uniform
random top-8 routing of T tokens, handed over as Megatron's all-to-all dispatcher does: on the host
(``--counts-on-device``: on the GPU), with float32 probs.

Passes: ``fwd`` and ``fwd+bwd`` (then the gradients of the rows and of every weight, ``torch.autograd.grad``). Each
provider and pass: CUDA-event times per iteration after warm-up (median, 10-90 percentile spread; ``sequential``
runs a quarter of the iterations), ``peak_gib``, TFLOP/s of the expert GEMMs (6 R H F per forward, three times
that for fwd+bwd), ``speedup`` (``sequential``'s median over the provider's; issue 60's target for ``moe_core``:
at least 3 on fwd+bwd) and ``max_abs_diff`` of the output against ``sequential``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench_common import (  # noqa: E402
    error_message,
    fmt,
    free_memory,
    peak_memory_gib,
    print_table,
    ratio,
    run_metadata,
    single_thread,
    timed,
)

# name: (tokens T, hidden H, expert ffn F, experts E, topk K)
SHAPES = {"qwen3_30b_a3b_4k": (4096, 2048, 768, 128, 8), "qwen3_30b_a3b_16k": (16384, 2048, 768, 128, 8)}
SMOKE_SHAPES = {"smoke": (64, 32, 16, 8, 2)}
PROVIDERS = ("sequential", "moe_core", "te_grouped_mlp")
PASSES = ("fwd", "fwd+bwd")


@contextlib.contextmanager
def megatron_parallel_state(device: torch.device):
    """Megatron's parallel state over a one-rank process group (this process's, or one made and ended here)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with contextlib.ExitStack() as stack:
        if not dist.is_initialized():
            init_file = stack.enter_context(tempfile.TemporaryDirectory()) + "/init"
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init_file}",
                                    rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel()
        stack.callback(parallel_state.destroy_model_parallel)
        if device.type == "cuda":
            model_parallel_cuda_manual_seed(0)
        yield


def megatron_config(hidden: int, ffn: int, experts: int, topk: int, device: torch.device, dtype: torch.dtype):
    """Megatron's ``TransformerConfig`` of the experts (SwiGLU, no bias, no fusions needing TransformerEngine)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, num_moe_experts=experts,
                             moe_router_topk=topk, moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn,
                             gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                             bias_activation_fusion=False, params_dtype=dtype,
                             use_cpu_initialization=device.type == "cpu")


def build_providers(names: list[str], config, num_experts: int) -> dict[str, torch.nn.Module]:
    """``{name: experts module}``, every one holding the ``sequential`` one's weights."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import build_module

    from moe_core.interop.megatron import (
        MoECoreGroupedMLP,
        sequential_to_grouped_keys,
        te_grouped_mlp_with_moe_core_linears,
    )

    pg_collection = get_default_pg_collection()
    sequential = SequentialMLP(num_experts, config, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), pg_collection=pg_collection)
    state = sequential.state_dict()
    modules = {}
    for name in names:
        if name == "sequential":
            modules[name] = sequential
        elif name == "moe_core":
            modules[name] = MoECoreGroupedMLP(num_experts, config, pg_collection=pg_collection)
            modules[name].load_state_dict(state)
        else:
            modules[name] = build_module(te_grouped_mlp_with_moe_core_linears(), num_experts, config,
                                         pg_collection=pg_collection)
            modules[name].load_state_dict(sequential_to_grouped_keys(state))
    return modules


def dispatched_rows(tokens: int, hidden: int, experts: int, topk: int, device: torch.device, dtype: torch.dtype,
                    counts_on_device: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [R, H], tokens_per_expert [E] int64, probs [R] float32, dy [R, H])`` with R = T * K, the counts of a
    uniform random top-K routing of T tokens (on the host unless ``counts_on_device``)."""
    chosen = torch.rand(tokens, experts).topk(topk, dim=1).indices
    counts = torch.bincount(chosen.flatten(), minlength=experts)
    rows = tokens * topk
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    probs = torch.rand(rows, device=device)
    dy = torch.randn(rows, hidden, device=device, dtype=dtype)
    return x, counts.to(device) if counts_on_device else counts, probs, dy


def pass_fn(module: torch.nn.Module, x, counts, probs, dy, name: str):
    params = list(module.parameters())
    if name == "fwd":
        return lambda: module(x, counts, probs)
    return lambda: torch.autograd.grad(module(x, counts, probs)[0], [x, *params], dy)


def bench_shape(shape: str, spec: tuple, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    tokens, hidden, ffn, experts, topk = spec
    torch.manual_seed(0)
    modules = build_providers(args.providers, megatron_config(hidden, ffn, experts, topk, device, dtype), experts)
    x, counts, probs, dy = dispatched_rows(tokens, hidden, experts, topk, device, dtype, args.counts_on_device)
    with torch.no_grad():
        outputs = {provider: module(x, counts, probs)[0].float() for provider, module in modules.items()}
    x.requires_grad_()
    base = dict(shape=shape, tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, topk=topk,
                dtype=str(dtype).removeprefix("torch."), counts_on_device=args.counts_on_device)
    rows = []
    for provider, module in modules.items():
        reference = outputs.get("sequential")
        diff = None if reference is None else (outputs[provider] - reference).abs().max().item()
        for name in args.passes:
            row = dict(base, provider=provider, max_abs_diff=diff, **{"pass": name})
            fn = pass_fn(module, x, counts, probs, dy, name)
            try:
                iters = max(2, args.iters // 4) if provider == "sequential" else args.iters
                row.update(timed(fn, iters, args.warmup, device), peak_gib=peak_memory_gib(fn, device))
                flops = (6 if name == "fwd" else 18) * tokens * topk * hidden * ffn
                row["tflops"] = flops / row["median_ms"] / 1e9
            except Exception as err:  # noqa: BLE001  (OOM, a failing kernel: recorded, the others go on)
                row["error"] = error_message(err)
                print(f"  {shape} {provider} {name}: {row['error']}", file=sys.stderr, flush=True)
            rows.append(row)
            free_memory()
    for row in rows:
        peer = next((r for r in rows if r["provider"] == "sequential" and r["pass"] == row["pass"]), {})
        row["speedup"] = ratio(peer.get("median_ms"), row.get("median_ms"))
    del modules
    free_memory()
    return rows


def print_rows(rows: list[dict]) -> None:
    print_table(rows, [("shape", 18), ("pass", 8), ("provider", 15)], [
        ("ms", 9, lambda r: f"{r['median_ms']:.3f}"), ("spread", 7, lambda r: f"{100 * r['spread']:.1f}%"),
        ("TFLOP/s", 8, lambda r: fmt(r["tflops"], ".1f")), ("vs seq", 7, lambda r: fmt(r["speedup"], ".2f")),
        ("peak GiB", 8, lambda r: fmt(r["peak_gib"], ".2f")),
        ("max diff", 9, lambda r: fmt(r["max_abs_diff"], ".2e")),
    ])


def _at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
        return value
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: all")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--iters", type=_at_least(1), help="timed iterations (default 20; --smoke 2)")
    parser.add_argument("--warmup", type=_at_least(0), help="untimed iterations first (default 3; --smoke 1)")
    parser.add_argument("--counts-on-device", action="store_true",
                        help="tokens_per_expert on the GPU (default: on the host, as Megatron's dispatcher gives them)")
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, a tiny shape, a few iterations")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.smoke and args.shapes:
        parser.error("--shapes: --smoke runs its own tiny shape")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: the benchmark needs one (or --smoke)")
    args.iters = args.iters or (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns the rows (also printed, and written to ``--json``)."""
    args = parse_args(argv)
    device, dtype = (torch.device("cpu"), torch.float32) if args.smoke else (torch.device("cuda"), torch.bfloat16)
    with warnings.catch_warnings():  # megatron-core's notes that TransformerEngine and Apex are absent
        warnings.simplefilter("ignore")
        import megatron.core
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.shapes or SHAPES}
    with single_thread(args.smoke), megatron_parallel_state(device):
        rows = [row for name, spec in shapes.items() for row in bench_shape(name, spec, args, device, dtype)]
    print_rows(rows)
    if args.json:
        meta = dict(run_metadata(device), megatron_core=megatron.core.__version__, args=vars(args))
        Path(args.json).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
