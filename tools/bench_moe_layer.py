"""Benchmark one MoE layer: moe_core's MoELayer against a torch-native layer and Hugging Face's Qwen3 MoE block.

    python3 tools/bench_moe_layer.py --json moe_layer.json                     # the full table (CUDA)
    python3 tools/bench_moe_layer.py --shapes qwen3_30b_a3b --providers moe_core moe_core_compiled native_compiled
    python3 tools/bench_moe_layer.py --smoke --json smoke.json                 # CPU, a tiny shape (the CI test)

Providers: ``moe_core`` (``MoELayer``, grouped-GEMM experts) eager and ``moe_core_compiled``
(``torch.compile(layer, fullgraph=True)``; ``--no-fullgraph`` lets it break the graph, ``--compile-mode
reduce-overhead`` replays CUDA graphs, for every compiled provider); the same two with
``moe_apply_probs_on_output`` (``moe_core_probs_on_output[_compiled]``: probs times each expert's output rather
than its activation, the placement A/B of issue 41); ``native`` and
``native_compiled``, torchtitan's design in plain PyTorch (tools/_native_moe.py); ``hf``, transformers'
``Qwen3MoeSparseMoeBlock`` with ``experts_implementation="grouped_mm"`` (when transformers is importable);
``sequential``, ``MoELayer`` with SequentialMLP experts (a quarter of the iterations). All compute one
function from the same bf16 weights: softmax router in fp32 over all experts, top-k renormalised (Qwen3's
``norm_topk_prob``; moe_core's ``moe_router_pre_softmax=False`` is the same function), SwiGLU experts, no bias,
no shared expert, no aux loss. HF's router linear runs in bf16 (its design), so a token near a tie may pick
other experts: each row's ``max_abs_diff`` against moe_core eager's output is the sanity check.

Passes: ``fwd``, the forward of a training step (autograd records), and ``fwd+bwd``, then the gradients of the
input and of every weight (``torch.autograd.grad``, nothing accumulates). Each provider and pass: CUDA-event
times per iteration after warm-up (median, 10-90 percentile spread), taken in --rounds rounds that time every
provider in turn (all providers are built first and held); ``peak_gib``, the peak of one call above
the memory allocated before it; one torch.profiler pass (``--profile-steps`` calls) summing kernel time into GEMM
(names matching ``_bench_common.GEMM``) and the rest, with the top 5 non-GEMM kernels; ``kernel_ms`` sums the GEMM
and the rest (on CUDA the durations of a call's kernels, memcpys and memsets: how far the median sits above it is the
host's share). TFLOP/s count the
expert GEMMs only: 6 T K H F per forward, three times that for fwd+bwd. Speed-ups are the reference's median
over the provider's (> 1: faster than the reference). A provider that fails (compile error, OOM) is printed
and recorded with ``error``; the others go on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench_common import (  # noqa: E402
    GEMM,
    breakdown,
    error_message,
    fmt,
    free_memory,
    iteration_ms,
    kernel_times,
    peak_memory_gib,
    ratio,
    run_metadata,
    single_thread,
    summarize,
    synchronize,
)
from _bench_common import (
    print_table as print_rows,
)
from _native_moe import NativeMoE  # noqa: E402

from moe_core import TransformerConfig  # noqa: E402
from moe_core.moe.moe_layer import MoELayer  # noqa: E402

# name: (tokens T, hidden H, expert ffn F, experts E, topk K)
SHAPES = {
    "qwen3_30b_a3b": (16384, 2048, 768, 128, 8),
    "olmoe": (16384, 2048, 1024, 64, 8),
    "mixtral": (8192, 4096, 14336, 8, 2),
    "ep8_local_16e_top1": (16384, 2048, 768, 16, 1),
    # EP 32's 8 local experts each receive about T rows: here every token goes to all 8.
    "deepseek_v3_ep32_local": (8192, 7168, 2048, 8, 8),
}
SMOKE_SHAPES = {"smoke": (64, 32, 16, 8, 2)}
PROVIDERS = ("moe_core", "moe_core_compiled", "moe_core_probs_on_output", "moe_core_probs_on_output_compiled", "native",
             "native_compiled", "hf", "sequential")
PASSES = ("fwd", "fwd+bwd")
REFERENCES = ("native", "native_compiled", "hf")  # the speed-up columns


def moe_config(tokens: int, hidden: int, ffn: int, experts: int, topk: int) -> TransformerConfig:
    """The Qwen3-style layer every provider computes, as a moe_core config (``tokens`` is unused)."""
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, num_moe_experts=experts,
                             moe_router_topk=topk, moe_ffn_hidden_size=ffn, activation_func="swiglu",
                             moe_router_score_function="softmax", moe_router_pre_softmax=False,
                             moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


@torch.no_grad()
def sequential_layer(layer: MoELayer) -> MoELayer:
    """A ``MoELayer`` with SequentialMLP experts holding copies of ``layer``'s weights."""
    weight = layer.experts.linear_fc1.weight
    with torch.device(weight.device):
        seq = MoELayer(dataclasses.replace(layer.config, moe_grouped_gemm=False)).to(weight.dtype)
    seq.router.weight.copy_(layer.router.weight)
    for e, expert in enumerate(seq.experts.local_experts):
        expert.linear_fc1.weight.copy_(layer.experts.linear_fc1.weight[e].t())
        expert.linear_fc2.weight.copy_(layer.experts.linear_fc2.weight[e].t())
    return seq


@torch.no_grad()
def probs_on_output_layer(layer: MoELayer) -> MoELayer:
    """``layer`` with ``moe_apply_probs_on_output``: the same weights, probs multiplying each expert's output
    instead of its activation (the same function, rounded elsewhere)."""
    weight = layer.experts.linear_fc1.weight
    with torch.device(weight.device):
        variant = MoELayer(dataclasses.replace(layer.config, moe_apply_probs_on_output=True)).to(weight.dtype)
    variant.load_state_dict(layer.state_dict())
    return variant


@torch.no_grad()
def hf_block(layer: MoELayer) -> torch.nn.Module:
    """transformers' ``Qwen3MoeSparseMoeBlock`` with grouped_mm experts and copies of ``layer``'s weights
    (``gate_up_proj`` ``[E, 2F, H]`` gate half first, ``down_proj`` ``[E, H, F]``). Raises ImportError without
    transformers."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = layer.config
    hf_config = Qwen3MoeConfig(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                               num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                               norm_topk_prob=True, hidden_act="silu", experts_implementation="grouped_mm")
    weight = layer.experts.linear_fc1.weight
    with torch.device(weight.device):
        block = Qwen3MoeSparseMoeBlock(hf_config).to(weight.dtype)
    if block.experts.config._experts_implementation != "grouped_mm":
        raise RuntimeError(f"hf: experts implementation {block.experts.config._experts_implementation!r}, "
                           "expected 'grouped_mm'")
    block.gate.weight.copy_(layer.router.weight)
    block.experts.gate_up_proj.copy_(layer.experts.linear_fc1.weight.transpose(1, 2))
    block.experts.down_proj.copy_(layer.experts.linear_fc2.weight.transpose(1, 2))
    return block


def build_provider(name: str, layer: MoELayer, args) -> tuple:
    """``(fn, params)``: ``fn(x [T, H]) -> [T, H]`` and the weights it differentiates."""
    if name.startswith("moe_core"):
        base = probs_on_output_layer(layer) if "probs_on_output" in name else layer
        return (_compiled(base, args) if name.endswith("_compiled") else base), list(base.parameters())
    if name in ("native", "native_compiled"):
        native = NativeMoE.from_moe_layer(layer)
        return (native if name == "native" else _compiled(native, args)), list(native.parameters())
    if name == "hf":
        block = hf_block(layer)
        return (lambda x: block(x.unsqueeze(0)).squeeze(0)), list(block.parameters())
    seq = sequential_layer(layer)
    return seq, list(seq.parameters())


def _compiled(module: torch.nn.Module, args):
    compiled = torch.compile(module, fullgraph=args.fullgraph, backend=args.compile_backend, mode=args.compile_mode)
    if args.compile_mode != "reduce-overhead":
        return compiled

    def step(x):  # each call a new CUDA-graph step: the previous call's outputs are not read again
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x)
    return step


def pass_fn(fn, params: list, x: torch.Tensor, dy: torch.Tensor, name: str):
    if name == "fwd":
        return lambda: fn(x)
    return lambda: torch.autograd.grad(fn(x), [x, *params], dy, allow_unused=True)


def timed_in_rounds(fns: dict, iters: dict, args, device: torch.device) -> tuple[dict, dict]:
    """``({key: summarize(samples)}, {key: error})`` for ``fns`` ``{key: fn}``: ``iters[key]`` timed calls each,
    split into ``args.rounds`` rounds that take the keys in turn, so that the machine's drift (the host's speed
    sets the pace of small layers) falls on every provider alike. The first round warms each key up with
    ``args.warmup`` calls, later ones with one. A key that fails is dropped from later rounds."""
    samples, errors = {key: [] for key in fns}, {}
    for round_index in range(args.rounds):
        for key, fn in fns.items():
            if key in errors:
                continue
            count = iters[key] // args.rounds + (round_index < iters[key] % args.rounds)
            try:
                for _ in range(args.warmup if round_index == 0 else 1):
                    fn()
                synchronize(device)
                samples[key] += iteration_ms(fn, count, device) if count else []
            except Exception as err:  # noqa: BLE001  (OOM, a failing kernel: recorded, the others go on)
                errors[key] = err
                free_memory()
    return {key: summarize(samples[key]) for key in fns if key not in errors}, errors


def profile_row(fn, args, device: torch.device) -> dict:
    """Peak memory and (unless --profile-steps 0) the GEMM / rest split of one provider and pass."""
    row = dict(peak_gib=peak_memory_gib(fn, device))
    if args.profile_steps:
        split = breakdown(kernel_times(fn, args.profile_steps, device), {"gemm": GEMM})
        gemm, rest, total = split["ms"]["gemm"], split["ms"]["rest"], split["total_ms"]
        row.update(gemm_ms=gemm, rest_ms=rest, kernel_ms=total, non_gemm_share=rest / total if total else None,
                   top_non_gemm=[dict(name=k["name"], ms=k["ms"]) for k in split["ranked"]
                                 if k["category"] != "gemm"][:5])
    return row


def bench_shape(shape: str, spec: tuple, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    tokens, hidden, ffn, experts, topk = spec
    torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no automatic dynamic shapes
    torch.manual_seed(0)
    with torch.device(device):
        layer = MoELayer(moe_config(*spec)).to(dtype)
        x = torch.randn(tokens, hidden, dtype=dtype).requires_grad_()
        dy = torch.randn(tokens, hidden, dtype=dtype)
    reference = layer(x).detach()
    base = dict(shape=shape, tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, topk=topk,
                dtype=str(dtype).removeprefix("torch."))
    rows, fns, iters = {}, {}, {}
    for provider in args.providers:  # every provider is built (and held) before any is timed
        try:
            fn, params = build_provider(provider, layer, args)
            diff = (fn(x).detach().float() - reference.float()).abs().max().item()
        except Exception as err:  # noqa: BLE001  (compile failure, OOM, missing transformers: recorded, go on)
            for p in args.passes:
                rows[provider, p] = dict(base, provider=provider, error=_report(shape, provider, "build", err),
                                         **{"pass": p})
            free_memory()
            continue
        for name in args.passes:
            rows[provider, name] = dict(base, provider=provider, max_abs_diff=diff, **{"pass": name})
            fns[provider, name] = pass_fn(fn, params, x, dy, name)
            iters[provider, name] = max(2, args.iters // 4) if provider == "sequential" else args.iters
    times, errors = timed_in_rounds(fns, iters, args, device)
    for key, fn in fns.items():
        row = rows[key]
        try:
            if key in errors:
                raise errors[key]
            row.update(times[key], **profile_row(fn, args, device))
            flops = (6 if key[1] == "fwd" else 18) * tokens * topk * hidden * ffn
            row["tflops"] = flops / row["median_ms"] / 1e9
        except Exception as err:  # noqa: BLE001
            row["error"] = _report(shape, key[0], key[1], err)
        free_memory()
    del fns
    free_memory()
    rows = [rows[p, name] for p in args.providers for name in args.passes]
    for row in rows:
        for ref in REFERENCES:
            peer = next((r for r in rows if r["provider"] == ref and r["pass"] == row["pass"]), {})
            row[f"speedup_vs_{ref}"] = ratio(peer.get("median_ms"), row.get("median_ms"))
    print(f"done {shape}", file=sys.stderr, flush=True)
    return rows


def _report(shape: str, provider: str, what: str, err: Exception) -> str:
    message = error_message(err)
    print(f"  {shape} {provider} {what}: {message}", file=sys.stderr, flush=True)
    return message


def print_table(rows: list[dict]) -> None:
    def pct(share):
        return None if share is None else 100 * share

    print_rows(rows, [("shape", 24), ("pass", 8), ("provider", 33)], [
        ("ms", 9, lambda r: f"{r['median_ms']:.3f}"), ("spread", 7, lambda r: f"{100 * r['spread']:.1f}%"),
        ("TFLOP/s", 8, lambda r: fmt(r["tflops"], ".1f")),
        ("vs native", 9, lambda r: fmt(r["speedup_vs_native"], ".2f")),
        ("vs nat_c", 9, lambda r: fmt(r["speedup_vs_native_compiled"], ".2f")),
        ("vs hf", 7, lambda r: fmt(r["speedup_vs_hf"], ".2f")), ("peak GiB", 8, lambda r: fmt(r["peak_gib"], ".2f")),
        ("non-GEMM %", 10, lambda r: fmt(pct(r.get("non_gemm_share")), ".1f")),
        ("kernel ms", 9, lambda r: fmt(r.get("kernel_ms"), ".3f")),
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: all")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--iters", type=int, help="timed iterations (default 20; --smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed iterations first (default 5; --smoke 1)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="the timed iterations split into rounds that take the providers in turn (default 4)")
    parser.add_argument("--profile-steps", type=int, default=3, help="calls under the profiler (0: no profile)")
    parser.add_argument("--no-fullgraph", dest="fullgraph", action="store_false",
                        help="let torch.compile break the graph")
    parser.add_argument("--compile-backend", help="torch.compile backend (default inductor; --smoke aot_eager)")
    parser.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                        help="torch.compile mode of the compiled providers (reduce-overhead: CUDA graphs)")
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, a tiny shape, a few iterations")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.smoke and args.shapes:
        parser.error("--shapes: --smoke runs its own tiny shape")
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    args.iters = args.iters or (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    args.compile_backend = args.compile_backend or ("aot_eager" if args.smoke else "inductor")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_moe_layer: needs a CUDA device (or --smoke)")
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.shapes or SHAPES}
    hf_version = _transformers_version()
    if hf_version is None and "hf" in args.providers:
        print("hf: transformers is not importable; skipped", file=sys.stderr)
        args.providers = [p for p in args.providers if p != "hf"]
    with single_thread(args.smoke):
        rows = [row for name, spec in shapes.items() for row in bench_shape(name, spec, args, device, dtype)]
    print_table(rows)
    if args.json:
        meta = dict(run_metadata(device), transformers=hf_version, args=vars(args))
        Path(args.json).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    return rows


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


if __name__ == "__main__":
    main()
