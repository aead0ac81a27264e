"""Benchmark moe_core's grouped GEMM against torch._grouped_mm, a per-expert matmul loop and a dense matmul.

Passes: forward (y = x_e W_e), dgrad (dx = dy_e W_e^T), wgrad (dW_e = x_e^T dy_e), wgrad_accum (main_grad_e +=
x_e^T dy_e into an fp32 main_grad, the wgrad under gradient-accumulation fusion; the other providers compute the
bf16 wgrad and add it into main_grad) and forward+backward (fwd, dgrad and wgrad). Each timing is the median of
per-iteration CUDA-event times, warm-up and measurement both measured in milliseconds (so clocks settle whatever
the problem size), repeated in rounds; within a round each pass is timed for every provider in turn
(timing_plan), so drift and the GPU's clock, which follows its recent load, hit the compared kernels alike; the
spread between rounds is reported as the noise floor. Inputs rotate over enough copies to exceed L2. TFLOP/s
count 2 T K N per pass (6 T K N for forward+backward). The dense provider multiplies the same total rows by one
weight: the ceiling a grouped kernel can hope for.

Usage: python3 tools/bench_grouped_gemm.py [--quick] [--sweep] [--tile TILE] [--batched] [--json out.json]
(--sweep instead times moe_core alone under every sm_90a schedule forced through MOE_CORE_GEMM_TILE,
MOE_CORE_GEMM_RASTER and MOE_CORE_GEMM_SWIZZLE, and prints the best per shape and pass: the heuristics'
tuning data; the tuning kernels run only in a build with MOE_CORE_SM90_TUNING=1, and the sweep skips them
elsewhere. --tile also times moe_core with MOE_CORE_GEMM_TILE=TILE forced, in the same rounds. --batched also
times cuBLAS's strided-batched GEMM (torch.bmm over [E, T / E, ...] views) on the shapes with equal counts, in
the same rounds: what a kernel given every group's size on the host reaches, which moe_core cannot be without a
host sync.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
from _bench_common import fmt, iteration_ms, ratio

import moe_core.ops  # noqa: F401  (registers torch.ops.moe_core.*)

SINGLE = ("fwd", "dgrad", "wgrad", "wgrad_accum")  # one op each
PASSES = SINGLE + ("fwd+bwd",)  # fwd+bwd: fwd, dgrad and wgrad
PROVIDERS = ("moe_core", "torch._grouped_mm", "loop", "dense")
BATCHED = "cublas_batched"  # --batched: equal counts only
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
    # The skew target compares like with like: the same experts and rows, uniform against Dirichlet counts.
    add("Qwen3-30B-A3B", 2048, 768, 128, 32768)
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


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long to warm up and measure each (provider, pass), in ms of wall time, and how many rounds."""
    warmup_ms: float
    measure_ms: float
    min_iters: int
    rounds: int


FULL = Timing(warmup_ms=30.0, measure_ms=60.0, min_iters=20, rounds=6)
QUICK = Timing(warmup_ms=15.0, measure_ms=25.0, min_iters=10, rounds=1)


def time_samples(fn, inputs: list, timing: Timing) -> list[float]:
    """Per-iteration CUDA-event times in ms after a warm-up of timing.warmup_ms, cycling through `inputs`
    (copies that together exceed L2); at least timing.min_iters and about timing.measure_ms of them."""
    start, done = time.perf_counter(), 0
    while True:
        fn(*inputs[done % len(inputs)])
        done += 1
        torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if elapsed_ms >= timing.warmup_ms:
            break
    iters = max(timing.min_iters, math.ceil(timing.measure_ms / (elapsed_ms / done)))
    return iteration_ms(fn, iters, torch.device("cuda"), inputs)


def time_ms(fn, inputs: list, timing: Timing) -> float:
    return statistics.median(time_samples(fn, inputs, timing))


def timing_plan(configs: list, rounds: int, passes: tuple) -> list[tuple[str, int]]:
    """(pass, index into configs [(provider, env)]) in the order they are timed.

    The GPU's clock follows its recent load: after the per-expert loop, which leaves the GPU idle between its
    small launches, the next provider runs on a cooler, faster-clocked chip, a bias large enough to move the
    ratios this benchmark reports. So the loop's rounds come first, and the compared providers (dense, moe_core,
    torch._grouped_mm, forced schedules) then take their rounds, each round timing every pass for each in turn,
    the order rotated by one every two rounds and reversed every other round: with three of them the six rounds
    take all six orders, so each takes each place in a round twice.
    """
    loop = [i for i, (provider, _) in enumerate(configs) if provider == "loop"]
    # Dense first: it takes the one timing right after the loop's (round 0's first).
    compared = sorted((i for i, (provider, _) in enumerate(configs) if provider != "loop"),
                      key=lambda i: configs[i][0] != "dense")
    plan = [(name, i) for _ in range(rounds) for name in passes for i in loop]
    for round_ in range(rounds):
        shift = round_ // 2 % len(compared)
        order = compared[shift:] + compared[:shift]
        plan += [(name, i) for name in passes for i in order[:: 1 if round_ % 2 == 0 else -1]]
    return plan


def pass_fns(provider: str, counts_gpu: torch.Tensor, counts_list: list[int], main_grad: torch.Tensor):
    """{pass: fn(x, w, dy)} for one provider; w is [E, K, N] bf16, main_grad [E, K, N] fp32 (wgrad_accum adds
    into it; the dense provider into its first expert's slice)."""
    ops = torch.ops.moe_core
    if provider == "moe_core":
        passes = {"fwd": lambda x, w, dy: ops.grouped_gemm(x, w, counts_gpu, False),
                  "dgrad": lambda x, w, dy: ops.grouped_gemm(dy, w, counts_gpu, True),
                  "wgrad": lambda x, w, dy: ops.grouped_gemm_wgrad(x, dy, counts_gpu, False),
                  "wgrad_accum": lambda x, w, dy: ops.grouped_gemm_wgrad_accum_(main_grad, x, dy, counts_gpu, False)}
    elif provider == "torch._grouped_mm":
        offs = torch.cumsum(counts_gpu, 0, dtype=torch.int32)
        passes = {"fwd": lambda x, w, dy: torch._grouped_mm(x, w, offs=offs),
                  "dgrad": lambda x, w, dy: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs),
                  "wgrad": lambda x, w, dy: torch._grouped_mm(x.t(), dy, offs=offs)}
    elif provider == "loop":
        passes = {
            "fwd": lambda x, w, dy: torch.cat([xe @ w[e] for e, xe in enumerate(x.split(counts_list))]),
            "dgrad": lambda x, w, dy: torch.cat([de @ w[e].t() for e, de in enumerate(dy.split(counts_list))]),
            "wgrad": lambda x, w, dy: torch.stack(
                [xe.t() @ de for xe, de in zip(x.split(counts_list), dy.split(counts_list), strict=True)]),
        }
    elif provider == BATCHED:
        e, rows = len(counts_list), counts_list[0]
        if any(c != rows for c in counts_list):
            raise ValueError(f"{BATCHED} needs equal counts, got {len(set(counts_list))} distinct ones")
        passes = {"fwd": lambda x, w, dy: torch.bmm(x.view(e, rows, -1), w),
                  "dgrad": lambda x, w, dy: torch.bmm(dy.view(e, rows, -1), w.transpose(1, 2)),
                  "wgrad": lambda x, w, dy: torch.bmm(x.view(e, rows, -1).transpose(1, 2), dy.view(e, rows, -1))}
    else:  # dense: the same rows against one expert's weight
        passes = {"fwd": lambda x, w, dy: x @ w[0],
                  "dgrad": lambda x, w, dy: dy @ w[0].t(),
                  "wgrad": lambda x, w, dy: x.t() @ dy}

    if "wgrad_accum" not in passes:
        wgrad, into = passes["wgrad"], main_grad[0] if provider == "dense" else main_grad
        passes["wgrad_accum"] = lambda x, w, dy: into.add_(wgrad(x, w, dy))

    def both(x, w, dy):
        for name in SINGLE[:3]:
            passes[name](x, w, dy)

    return {**passes, "fwd+bwd": both}


SM90_TILES = ("128x256", "128x128", "128x256c21", "128x128pp", "256x128c21")
TUNING_TILES = ("128x128pp", "256x128c21")  # built only with MOE_CORE_SM90_TUNING=1 (setup.py)
# The row-tile kernel walks its own work list, so the scheduler walk and swizzle do not apply to it.
SWEEP = [dict(MOE_CORE_GEMM_TILE=tile, MOE_CORE_GEMM_RASTER=raster, MOE_CORE_GEMM_SWIZZLE=str(swizzle))
         for tile in SM90_TILES for raster in "mn" for swizzle in (1, 2, 4)] + [dict(MOE_CORE_GEMM_TILE="rows")]


def schedule_name(env: dict | None) -> str:
    return "/".join(env.values()) if env else "default"


def tuning_left_out() -> bool:
    """Whether this build leaves out the sm_90a tuning kernels: a small call forcing one raises then (on Hopper;
    elsewhere the portable kernel runs whatever is forced)."""
    x, w = torch.zeros(256, 64, device="cuda", dtype=torch.bfloat16), torch.zeros(2, 64, 64, device="cuda",
                                                                                    dtype=torch.bfloat16)
    os.environ["MOE_CORE_GEMM_TILE"] = TUNING_TILES[0]
    try:
        torch.ops.moe_core.grouped_gemm(x, w, torch.tensor([128, 128], device="cuda"), False)
        torch.cuda.synchronize()
    except RuntimeError as err:
        if "MOE_CORE_SM90_TUNING" not in str(err):
            raise
        return True
    finally:
        os.environ.pop("MOE_CORE_GEMM_TILE")
    return False


def bench_shape(spec: dict, timing: Timing, gen: torch.Generator, sweep: list[dict] | None = None,
                tile: str | None = None, batched: bool = False) -> dict:
    k, n, e, t = spec["k"], spec["n"], spec["e"], spec["t"]
    counts = make_counts(e, t, spec["skew"], gen)
    bytes_per_copy = 2 * (t * k + e * k * n + t * n)
    copies = max(1, min(8, math.ceil(ROTATE_BYTES / max(bytes_per_copy, 1))))
    inputs = [(torch.randn(t, k, device="cuda", dtype=torch.bfloat16),
               torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) / math.sqrt(k),
               torch.randn(t, n, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    counts_gpu = counts.cuda()
    main_grad = torch.zeros(e, k, n, device="cuda", dtype=torch.float32)
    # (provider, forced sm_90a schedule or None): the sweep times moe_core once per schedule.
    configs = [("moe_core", None)] + [("moe_core", env) for env in sweep] if sweep else [(p, None) for p in PROVIDERS]
    if tile:
        configs.append(("moe_core", dict(MOE_CORE_GEMM_TILE=tile)))
    if batched and len(set(counts.tolist())) == 1:
        configs.append((BATCHED, None))
    passes = SINGLE if sweep else PASSES
    rounds: dict = {}  # (provider, schedule, pass) -> [median of each round]
    failed = set()
    fns = [pass_fns(provider, counts_gpu, counts.tolist(), main_grad) for provider, _ in configs]
    for name, i in timing_plan(configs, timing.rounds, passes):
        provider, env = configs[i]
        key = (provider, schedule_name(env), name)
        if key in failed:
            continue
        os.environ.update(env or {})
        try:
            rounds.setdefault(key, []).append(time_ms(fns[i][name], inputs, timing))
        except RuntimeError as err:  # e.g. torch._grouped_mm unsupported on this GPU or shape
            print(f"  {provider} {name}: {str(err).splitlines()[0]}", file=sys.stderr)
            failed.add(key)
        for var in env or {}:
            os.environ.pop(var)
    result = dict(spec, empty_experts=int((counts == 0).sum()), ms={}, tflops={}, round_spread={})
    for (provider, schedule, name), medians in rounds.items():
        ms = statistics.median(medians)
        tflops = (6 if name == "fwd+bwd" else 2) * t * k * n / ms / 1e9
        if schedule == "default":
            result["ms"].setdefault(provider, {})[name] = ms
            result["tflops"].setdefault(provider, {})[name] = tflops
            result["round_spread"].setdefault(provider, {})[name] = max(medians) / min(medians) - 1
        else:
            result.setdefault("schedule_tflops", {}).setdefault(schedule, {})[name] = tflops
    del inputs, main_grad, fns
    torch.cuda.empty_cache()
    return result


def print_sweep(results: list[dict]) -> None:
    """Per shape and pass: the default schedule, the best forced one and the top three."""
    print(f"{'shape':40s} {'pass':11s} {'default':>8s} {'best':>8s}  top three (tile/raster/swizzle TFLOP/s)")
    for r in results:
        for name in SINGLE:
            ranked = sorted(((tf[name], sched) for sched, tf in r["schedule_tflops"].items() if name in tf),
                            reverse=True)
            top = ", ".join(f"{sched} {tf:.0f}" for tf, sched in ranked[:3])
            print(f"{r['name']:40s} {name:11s} {r['tflops']['moe_core'][name]:8.1f} {ranked[0][0]:8.1f}  {top}")


def print_forced_tile(results: list[dict], tile: str) -> None:
    """moe_core with MOE_CORE_GEMM_TILE=tile forced, against its default schedule and torch._grouped_mm."""
    print(f"\nforced tile {tile}: {'shape':40s} {'pass':11s} {'TFLOP/s':>8s} {'vs default':>10s} "
          f"{'vs _grouped_mm':>14s}")
    geo: dict = {}
    for r in results:
        for name, tf in r["schedule_tflops"][tile].items():
            vs_default = ratio(tf, r["tflops"]["moe_core"].get(name))
            vs_gmm = ratio(tf, r["tflops"].get("torch._grouped_mm", {}).get(name))
            geo.setdefault(name, []).append(vs_gmm)
            print(f"{'':13s} {r['name']:40s} {name:11s} {tf:8.1f} {fmt(vs_default, '10.2f')} {fmt(vs_gmm, '14.2f')}")
    print(f"forced tile {tile}, geomean vs torch._grouped_mm: " + ", ".join(
        f"{k} {math.exp(sum(map(math.log, v)) / len(v)):.2f}x" for k, v in geo.items() if all(v)))


def batched_ceiling(results: list[dict]) -> dict:
    """cuBLAS's strided-batched GEMM on the equal-count shapes, against torch._grouped_mm and moe_core: per pass,
    the geometric means over the shapes it ran of cublas_batched / torch._grouped_mm and moe_core /
    cublas_batched; printed with a row per shape and pass, and returned."""
    ran = [r for r in results if BATCHED in r["tflops"]]
    if not ran:
        return {}
    print(f"\n{'shape':40s} {'pass':11s} {BATCHED:>15s} {'vs _grouped_mm':>14s} {'moe_core vs it':>14s}")
    logs: dict = {}
    for r in ran:
        for name, tf in r["tflops"][BATCHED].items():
            vs_gmm, mine = ratio(tf, r["tflops"]["torch._grouped_mm"][name]), ratio(r["tflops"]["moe_core"][name], tf)
            logs.setdefault(name, []).append((math.log(vs_gmm), math.log(mine)))
            print(f"{r['name']:40s} {name:11s} {tf:15.1f} {vs_gmm:14.3f} {mine:14.3f}")
    out = {name: dict(vs_grouped_mm=math.exp(statistics.fmean(a for a, _ in v)),
                      moe_core_vs_batched=math.exp(statistics.fmean(b for _, b in v)), shapes=len(v))
           for name, v in logs.items()}
    print(f"geomean over the {len(ran)} equal-count shapes: " + ", ".join(
        f"{name} {BATCHED} / torch._grouped_mm {g['vs_grouped_mm']:.3f}x, moe_core / {BATCHED} "
        f"{g['moe_core_vs_batched']:.3f}x" for name, g in out.items()))
    return out


def device_ceilings() -> dict:
    """The two measured ceilings: HBM bandwidth (a 1 GiB device-to-device copy, bytes read + written) and the
    bf16 matrix rate (one 8192^3 dense matmul)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda a, b: b.copy_(a), [(src, dst)], FULL)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = time_ms(lambda x, y: x @ y, [(a, a)], FULL)
    return dict(hbm_gb_s=2 * (1 << 30) / copy_ms / 1e6, bf16_tflops=2 * 8192**3 / mm_ms / 1e9)


def empty_call_latency_us() -> dict:
    """An all-empty call (T == 0, 128 experts, Qwen3 fc1 weights), forward and forward+backward, per provider:
    ``eager``, microseconds per call of back-to-back calls from Python (host-bound: launch cost included, what
    an eager training step pays); ``graph``, the GPU time per call of the same calls replayed from a CUDA graph."""
    x = torch.empty(0, 2048, device="cuda", dtype=torch.bfloat16)
    dy = torch.empty(0, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 2048, 1536, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(128, dtype=torch.int64, device="cuda")
    calls_per_graph = 20
    out: dict = {}
    for provider in ("moe_core", "torch._grouped_mm"):
        fns = pass_fns(provider, counts, [0] * 128, torch.zeros(128, 2048, 1536, device="cuda"))
        for name in ("fwd", "fwd+bwd"):
            fn = fns[name]
            try:
                eager = 1e3 * time_ms(fn, [(x, w, dy)], FULL)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn(x, w, dy)  # allocations and one-time setup happen outside the capture
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(calls_per_graph):
                        fn(x, w, dy)
                graph_us = 1e3 * time_ms(graph.replay, [()], FULL) / calls_per_graph
            except RuntimeError as err:
                print(f"  all-empty {provider} {name}: {str(err).splitlines()[0]}", file=sys.stderr)
                continue
            out.setdefault(provider, {})[name] = dict(eager=eager, graph=graph_us)
    return out


def print_table(results: list[dict]) -> dict:
    header = f"{'shape':40s} {'pass':11s} " + " ".join(f"{p:>17s}" for p in PROVIDERS) + "  vs_gmm  vs_dense"
    print(header)
    print("-" * len(header))
    geo = {}
    for r in results:
        for name in PASSES:
            tf = {p: r["tflops"].get(p, {}).get(name) for p in PROVIDERS}
            vs_gmm, vs_dense = ratio(tf["moe_core"], tf["torch._grouped_mm"]), ratio(tf["moe_core"], tf["dense"])
            if vs_gmm:
                geo.setdefault(name, []).append(vs_gmm)
            print(f"{r['name']:40s} {name:11s} " + " ".join(f"{fmt(tf[p]):>17s}" for p in PROVIDERS)
                  + f"  {fmt(vs_gmm, '6.2f')}  {fmt(vs_dense, '6.2f')}")
    geomeans = {name: math.exp(sum(map(math.log, v)) / len(v)) for name, v in geo.items()}
    print("geomean moe_core / torch._grouped_mm: " + ", ".join(f"{k} {v:.2f}x" for k, v in geomeans.items()))
    print("min moe_core / torch._grouped_mm: " + ", ".join(f"{k} {min(v):.2f}x" for k, v in geo.items()))
    spreads = [s for r in results for per_pass in r["round_spread"].values() for s in per_pass.values()]
    if spreads:
        print(f"noise: largest spread between rounds of one provider and pass {100 * max(spreads):.1f}%, "
              f"median {100 * statistics.median(spreads):.1f}%")
    return geomeans


def skewed_vs_uniform(results: list[dict]) -> dict:
    """moe_core's TFLOP/s on Dirichlet-skewed counts over the same shape (K, N, E, T) with uniform counts, per
    pass and skewed shape; printed and returned."""
    uniform = {(r["k"], r["n"], r["e"], r["t"]): r for r in results if r["skew"] is None}
    out = {}
    for r in results:
        base = uniform.get((r["k"], r["n"], r["e"], r["t"])) if r["skew"] is not None else None
        if base is None:
            continue
        out[r["name"]] = {name: ratio(tf, base["tflops"]["moe_core"].get(name))
                          for name, tf in r["tflops"]["moe_core"].items()}
        print(f"{r['name']} / uniform counts, moe_core: " + ", ".join(
            f"{name} {fmt(v, '.2f')}x" for name, v in out[r["name"]].items()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    parser.add_argument("--sweep", action="store_true", help="time moe_core under every sm_90a schedule")
    parser.add_argument("--tile", help="also time moe_core with this MOE_CORE_GEMM_TILE forced")
    parser.add_argument("--batched", action="store_true",
                        help=f"also time cuBLAS's strided-batched GEMM ({BATCHED}) on the equal-count shapes")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_grouped_gemm: needs a CUDA device")
    timing = QUICK if args.quick or args.sweep else FULL
    left_out = (args.sweep or args.tile in TUNING_TILES) and tuning_left_out()
    if args.tile in TUNING_TILES and left_out and not args.sweep:
        sys.exit(f"bench_grouped_gemm: --tile {args.tile} is a tuning kernel this build leaves out; rebuild with "
                 "MOE_CORE_SM90_TUNING=1")
    sweep = None
    if args.sweep:
        sweep = [env for env in SWEEP if not (left_out and env["MOE_CORE_GEMM_TILE"] in TUNING_TILES)]
        if left_out:
            print(f"sweep: skipping the tuning kernels {', '.join(TUNING_TILES)}, which this build leaves out "
                  "(rebuild with MOE_CORE_SM90_TUNING=1 to time them)", file=sys.stderr)
    torch.manual_seed(0)  # the Dirichlet draws
    gen = torch.Generator().manual_seed(0)
    results = []
    for spec in shapes(args.quick):
        results.append(bench_shape(spec, timing, gen, sweep, None if args.sweep else args.tile,
                                   args.batched and not args.sweep))
        print(f"done {spec['name']}", file=sys.stderr, flush=True)
    if args.sweep:
        print_sweep(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f,
                          indent=1)
        return
    geomeans = print_table(results)
    skew = skewed_vs_uniform(results)
    if args.tile:
        print_forced_tile(results, args.tile)
    batched = batched_ceiling(results)
    ceilings = device_ceilings()
    print(f"ceilings: HBM copy {ceilings['hbm_gb_s']:.0f} GB/s, "
          f"dense bf16 matmul {ceilings['bf16_tflops']:.0f} TFLOP/s")
    latency = empty_call_latency_us()
    for provider, per_pass in latency.items():
        print(f"all-empty call (T=0, E=128, 2048->1536), {provider}: " + ", ".join(
            f"{name} {v['eager']:.1f} us eager / {v['graph']:.1f} us GPU in a CUDA graph"
            for name, v in per_pass.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results,
                           geomean_vs_grouped_mm=geomeans, skewed_vs_uniform=skew, batched_ceiling=batched,
                           empty_call_us=latency, ceilings=ceilings), f, indent=1)


if __name__ == "__main__":
    main()
