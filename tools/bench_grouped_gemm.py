"""Benchmark moe_core's grouped GEMM against torch._grouped_mm, a per-expert matmul loop and a dense matmul.

Passes: forward (y = x_e W_e), dgrad (dx = dy_e W_e^T), wgrad (dW_e = x_e^T dy_e) and forward+backward (all
three). Each timing is the median of per-iteration CUDA-event times after warm-up, with inputs rotated over
enough copies to exceed L2. TFLOP/s count 2 T K N per pass (6 T K N for forward+backward). The dense
provider multiplies the same total rows by one weight: the ceiling a grouped kernel can hope for.

Usage: python3 tools/bench_grouped_gemm.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

import moe_core.ops  # noqa: F401  (registers torch.ops.moe_core.*)

PASSES = ("fwd", "dgrad", "wgrad", "fwd+bwd")
PROVIDERS = ("moe_core", "torch._grouped_mm", "loop", "dense")
ROTATE_BYTES = 256 << 20  # about 5x an H100's L2


def shapes(quick: bool) -> list[dict]:
    """(name, K, N, E, T, skew) of the model shapes; fc1 is H -> 2F (gated), fc2 F -> H."""
    out = []

    def add(model, hidden, ffn, experts, rows, skew=None):
        out.append(dict(name=f"{model} fc1 E{experts} T{rows}" + (" skewed" if skew else ""), k=hidden,
                        n=2 * ffn, e=experts, t=rows, skew=skew))
        out.append(dict(name=f"{model} fc2 E{experts} T{rows}" + (" skewed" if skew else ""), k=ffn, n=hidden,
                        e=experts, t=rows, skew=skew))

    add("Qwen3-30B-A3B", 2048, 768, 128, 65536)
    add("Qwen3-30B-A3B", 2048, 768, 16, 16384)
    if not quick:
        add("Mixtral-8x7B", 4096, 14336, 8, 8192)
        add("DeepSeek-V3", 7168, 2048, 8, 16384)
    add("OLMoE", 2048, 1024, 64, 32768)
    add("Qwen3-30B-A3B", 2048, 768, 128, 32768, skew=0.3)
    out.append(dict(name="Qwen3-30B-A3B fc1 E64 T256", k=2048, n=1536, e=64, t=256, skew=None))
    return out


def make_counts(e: int, t: int, skew: float | None, gen: torch.Generator) -> torch.Tensor:
    if skew is None:
        counts = torch.full((e,), t // e, dtype=torch.int64)
        counts[: t - int(counts.sum())] += 1
        return counts
    probs = torch.distributions.Dirichlet(torch.full((e,), skew)).sample()
    counts = torch.multinomial(probs, t, replacement=True, generator=gen).bincount(minlength=e)
    return counts.to(torch.int64)


def time_ms(fn, inputs: list, iters: int, warmup: int) -> float:
    """Median per-iteration time in ms, cycling through `inputs` (copies that together exceed L2)."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        args = inputs[i % len(inputs)]
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def pass_fns(provider: str, counts_gpu: torch.Tensor, counts_list: list[int]):
    """{pass: fn(x, w, dy)} for one provider; w is [E, K, N] bf16."""
    ops = torch.ops.moe_core
    if provider == "moe_core":
        fwd = lambda x, w, dy: ops.grouped_gemm(x, w, counts_gpu, False)
        dgrad = lambda x, w, dy: ops.grouped_gemm(dy, w, counts_gpu, True)
        wgrad = lambda x, w, dy: ops.grouped_gemm_wgrad(x, dy, counts_gpu, False)
    elif provider == "torch._grouped_mm":
        offs = torch.cumsum(counts_gpu, 0, dtype=torch.int32)
        fwd = lambda x, w, dy: torch._grouped_mm(x, w, offs=offs)
        dgrad = lambda x, w, dy: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)
        wgrad = lambda x, w, dy: torch._grouped_mm(x.t(), dy, offs=offs)
    elif provider == "loop":
        def fwd(x, w, dy):
            return torch.cat([xe @ w[e] for e, xe in enumerate(x.split(counts_list))])

        def dgrad(x, w, dy):
            return torch.cat([de @ w[e].t() for e, de in enumerate(dy.split(counts_list))])

        def wgrad(x, w, dy):
            return torch.stack([xe.t() @ de for xe, de in zip(x.split(counts_list), dy.split(counts_list))])
    else:  # dense: the same rows against one expert's weight
        fwd = lambda x, w, dy: x @ w[0]
        dgrad = lambda x, w, dy: dy @ w[0].t()
        wgrad = lambda x, w, dy: x.t() @ dy

    def both(x, w, dy):
        fwd(x, w, dy)
        dgrad(x, w, dy)
        wgrad(x, w, dy)

    return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad, "fwd+bwd": both}


def bench_shape(spec: dict, iters: int, warmup: int, gen: torch.Generator) -> dict:
    k, n, e, t = spec["k"], spec["n"], spec["e"], spec["t"]
    counts = make_counts(e, t, spec["skew"], gen)
    bytes_per_copy = 2 * (t * k + e * k * n + t * n)
    copies = max(1, min(8, math.ceil(ROTATE_BYTES / max(bytes_per_copy, 1))))
    inputs = [(torch.randn(t, k, device="cuda", dtype=torch.bfloat16),
               torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) / math.sqrt(k),
               torch.randn(t, n, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    counts_gpu = counts.cuda()
    result = dict(spec, empty_experts=int((counts == 0).sum()), ms={}, tflops={})
    for provider in PROVIDERS:
        fns = pass_fns(provider, counts_gpu, counts.tolist())
        for name in PASSES:
            flops = (6 if name == "fwd+bwd" else 2) * t * k * n
            try:
                ms = time_ms(fns[name], inputs, iters, warmup)
            except RuntimeError as err:  # e.g. torch._grouped_mm unsupported on this GPU or shape
                print(f"  {provider} {name}: {str(err).splitlines()[0]}", file=sys.stderr)
                continue
            result["ms"].setdefault(provider, {})[name] = ms
            result["tflops"].setdefault(provider, {})[name] = flops / ms / 1e9
    del inputs
    torch.cuda.empty_cache()
    return result


def empty_call_latency_us(iters: int) -> dict:
    """Latency of an all-empty call (T == 0, 128 experts, Qwen fc1 weights): forward and the three passes."""
    x = torch.empty(0, 2048, device="cuda", dtype=torch.bfloat16)
    dy = torch.empty(0, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 2048, 1536, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(128, dtype=torch.int64, device="cuda")
    fns = pass_fns("moe_core", counts, [0] * 128)
    return {name: 1e3 * time_ms(fns[name], [(x, w, dy)], iters, 10) for name in ("fwd", "fwd+bwd")}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(v: float | None, spec: str = "7.1f") -> str:
    return format(v, spec) if v is not None else "    n/a"


def print_table(results: list[dict]) -> dict:
    header = f"{'shape':40s} {'pass':8s} " + " ".join(f"{p:>17s}" for p in PROVIDERS) + "  vs_gmm  vs_dense"
    print(header)
    print("-" * len(header))
    geo = {}
    for r in results:
        for name in PASSES:
            tf = {p: r["tflops"].get(p, {}).get(name) for p in PROVIDERS}
            vs_gmm, vs_dense = ratio(tf["moe_core"], tf["torch._grouped_mm"]), ratio(tf["moe_core"], tf["dense"])
            if vs_gmm:
                geo.setdefault(name, []).append(vs_gmm)
            print(f"{r['name']:40s} {name:8s} " + " ".join(f"{fmt(tf[p]):>17s}" for p in PROVIDERS)
                  + f"  {fmt(vs_gmm, '6.2f')}  {fmt(vs_dense, '6.2f')}")
    geomeans = {name: math.exp(sum(map(math.log, v)) / len(v)) for name, v in geo.items()}
    print("geomean moe_core / torch._grouped_mm: " + ", ".join(f"{k} {v:.2f}x" for k, v in geomeans.items()))
    return geomeans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_grouped_gemm: needs a CUDA device")
    iters, warmup = (10, 3) if args.quick else (30, 5)
    torch.manual_seed(0)  # the Dirichlet draws
    gen = torch.Generator().manual_seed(0)
    results = []
    for spec in shapes(args.quick):
        results.append(bench_shape(spec, iters, warmup, gen))
        print(f"done {spec['name']}", file=sys.stderr, flush=True)
    geomeans = print_table(results)
    latency = empty_call_latency_us(200)
    print(f"all-empty call (T=0, E=128, 2048->1536): fwd {latency['fwd']:.1f} us, fwd+bwd {latency['fwd+bwd']:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results,
                           geomean_vs_grouped_mm=geomeans, empty_call_us=latency), f, indent=1)


if __name__ == "__main__":
    main()
