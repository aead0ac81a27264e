"""Benchmark one MoE layer under expert parallelism against the same layer on one GPU.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --standalone --nproc-per-node 2 tools/bench_moe_layer_ep.py --json $OUT/moe_layer_ep.json
    ... --shapes qwen3_30b_a3b --tokens 16384 --dispatchers alltoall allgather
    ... --shared-expert-size 2048             # + a shared expert, moe_shared_expert_overlap off and on
    ... --moe-dispatch-sync-free --compile    # the sync-free exchange, every provider under torch.compile
    torchrun --standalone --nproc-per-node 2 tools/bench_moe_layer_ep.py --smoke   # CPU (gloo), a tiny shape

Shapes (hidden H, expert ffn F, experts E, top-k K): ``qwen3_30b_a3b`` (2048, 768, 128, 8) and ``mixtral`` (4096,
14336, 8, 2), each at every --tokens per rank (default 4096 and 16384). The layer is moe_core's ``MoELayer``:
softmax router in fp32 over all experts, top-k renormalised, SwiGLU GroupedMLP experts, no bias, no aux loss, bf16
weights, eager unless --compile (``torch.compile`` of each provider's layer, ep1 included; with
--moe-dispatch-sync-free the EP layer traces whole).

Providers, per shape and tokens: ``ep1``, the layer with all E experts on one GPU and T tokens, run on every rank at
once on its own GPU (no communication; the same per-GPU work as EP in expectation); ``ep``, the layer with EP = the
world size, each rank holding E / EP experts (the same weights, sliced) and its own T tokens, per --dispatchers;
with --shared-expert-size, ``ep`` (overlap off) and ``ep_overlap`` (``moe_shared_expert_overlap``). Passes:
``forward`` (autograd recording) and ``backward`` (the gradients of the input and of every weight) of one step, timed
in the same iteration after a barrier, CUDA events per phase; each figure is the slowest rank's median over --iters
after --warmup. ``vs_ep1``: the provider's time over ep1's (1.0: EP costs nothing; the target is the throughput
per GPU, so its inverse). ``max_abs_diff``: the largest difference between a rank's EP output and ep1's on the same
tokens, the sanity check (bf16 rounding only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench_common import free_memory, run_metadata, single_thread  # noqa: E402
from _bench_dist import lockstep_ms, rank_device, slowest_rank  # noqa: E402

from moe_core import TransformerConfig  # noqa: E402
from moe_core.models.full_state import load_full_state_dict  # noqa: E402
from moe_core.moe.dispatcher_factory import EP_DISPATCHERS  # noqa: E402
from moe_core.moe.moe_layer import MoELayer  # noqa: E402
from moe_core.parallel.launch import destroy_distributed, init_distributed  # noqa: E402
from moe_core.parallel.process_groups import ProcessGroupCollection  # noqa: E402

# name: (hidden H, expert ffn F, experts E, topk K)
SHAPES = {"qwen3_30b_a3b": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}
SMOKE_SHAPE = {"smoke": (32, 16, 8, 2)}
PASSES = ("forward", "backward")


def layer_config(hidden: int, ffn: int, experts: int, topk: int, ep: int = 1, dispatcher: str = "alltoall",
                 shared: int | None = None, overlap: bool = False, sync_free: bool = False) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, num_moe_experts=experts,
                             moe_router_topk=topk, moe_ffn_hidden_size=ffn, activation_func="swiglu",
                             moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                             moe_shared_expert_intermediate_size=shared, moe_shared_expert_overlap=overlap,
                             moe_token_dispatcher_type=dispatcher, moe_dispatch_sync_free=sync_free,
                             expert_model_parallel_size=ep)


def ep_layer(full: MoELayer, config: TransformerConfig, pg: ProcessGroupCollection) -> MoELayer:
    """``MoELayer(config, pg)`` holding ``full``'s weights, this EP rank's experts of them."""
    with torch.device(full.router.weight.device):
        layer = MoELayer(config, pg).to(full.router.weight.dtype)
    load_full_state_dict(layer, full.state_dict(), pg)
    return layer


def step_phases(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor):
    """One forward, then the gradients of x and every weight, yielding each phase's name."""
    params = list(layer.parameters())
    out = layer(x)
    yield "forward"
    torch.autograd.grad(out, [x, *params], dy)
    yield "backward"


def timed_rows(layer: torch.nn.Module, x, dy, args, device, base: dict) -> list[dict]:
    times = lockstep_ms(lambda: step_phases(layer, x, dy), args.iters, args.warmup, device)
    stats = slowest_rank([f(times[p]) for p in PASSES for f in (statistics.median, min)], device)
    return [dict(base, median_ms=stats[2 * i], min_ms=stats[2 * i + 1], **{"pass": p}) for i, p in enumerate(PASSES)]


def _compiled(layer: MoELayer) -> torch.nn.Module:
    """``torch.compile(layer)`` from a fresh Dynamo cache: every layer shares ``MoELayer.forward``'s code object, whose
    cache would otherwise reach the recompile limit and run later layers eagerly; past the limit, fail."""
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(layer)


def bench_shape(name: str, spec: tuple, tokens: int, args, pg: ProcessGroupCollection, device, dtype) -> list[dict]:
    hidden, ffn, experts, topk = spec
    torch.manual_seed(0)  # the same full layer on every rank
    with torch.device(device):
        full = MoELayer(layer_config(*spec, shared=args.shared_expert_size)).to(dtype)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    base = dict(shape=name, tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, topk=topk, ep=pg.ep_size,
                dtype=str(dtype).removeprefix("torch."), shared_expert_size=args.shared_expert_size,
                sync_free=args.moe_dispatch_sync_free, compiled=args.compile)
    compiled = _compiled if args.compile else (lambda layer: layer)
    with torch.no_grad():
        reference = full(x)
    rows = timed_rows(compiled(full), x, dy, args, device, dict(base, provider="ep1", dispatcher=None))
    free_memory()
    variants = [("ep", False)] + ([("ep_overlap", True)] if args.shared_expert_size else [])
    for dispatcher in args.dispatchers:
        for provider, overlap in variants:
            config = layer_config(*spec, ep=pg.ep_size, dispatcher=dispatcher, shared=args.shared_expert_size,
                                  overlap=overlap, sync_free=args.moe_dispatch_sync_free)
            layer = compiled(ep_layer(full, config, pg))
            # With grad on, as timed: one compiled graph per layer.
            diff = (layer(x).detach().float() - reference.float()).abs().max().item() if tokens else 0.0
            rows += timed_rows(layer, x, dy, args, device,
                               dict(base, provider=provider, dispatcher=dispatcher,
                                    max_abs_diff=slowest_rank([diff], device)[0]))
            del layer
            free_memory()
    for row in rows:
        ep1 = next(r for r in rows if r["provider"] == "ep1" and r["pass"] == row["pass"])
        row["vs_ep1"] = row["median_ms"] / ep1["median_ms"]
    if dist.get_rank() == 0:
        print(f"done {name} T={tokens}", file=sys.stderr, flush=True)
    return rows


def run(args, pg: ProcessGroupCollection) -> list[dict]:
    """Every row (collective: every rank calls it)."""
    device = rank_device()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SMOKE_SHAPE if args.smoke else {name: SHAPES[name] for name in args.shapes}
    with single_thread(args.smoke):
        return [row for name, spec in shapes.items() for tokens in args.tokens
                for row in bench_shape(name, spec, tokens, args, pg, device, dtype)]


def print_table(rows: list[dict]) -> None:
    header = (f"{'shape':14s} {'T/rank':>7s} {'provider':11s} {'dispatcher':10s} {'pass':9s} {'median ms':>10s} "
              f"{'vs ep1':>7s} {'max diff':>9s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['shape']:14s} {r['tokens']:7d} {r['provider']:11s} {r['dispatcher'] or '-':10s} {r['pass']:9s} "
              f"{r['median_ms']:10.3f} {r['vs_ep1']:7.2f} {r.get('max_abs_diff', 0.0):9.2e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, help="tokens per rank (default 4096 16384; --smoke 24)")
    parser.add_argument("--dispatchers", nargs="+", choices=sorted(EP_DISPATCHERS), default=["alltoall"])
    parser.add_argument("--shared-expert-size", type=int, default=None,
                        help="add a shared expert of this width; time moe_shared_expert_overlap off and on")
    parser.add_argument("--moe-dispatch-sync-free", action="store_true",
                        help="the EP providers dispatch without a host sync (moe_dispatch_sync_free)")
    parser.add_argument("--compile", action="store_true", help="torch.compile every provider's layer")
    parser.add_argument("--iters", type=int, help="timed iterations (default 20; --smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed iterations first (default 5; --smoke 1)")
    parser.add_argument("--smoke", action="store_true", help="a tiny float32 shape, a few iterations (CPU / gloo)")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or ([24] if args.smoke else [4096, 16384])
    args.iters = args.iters or (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    experts = [spec[2] for spec in (SMOKE_SHAPE.values() if args.smoke else (SHAPES[s] for s in args.shapes))]
    if world < 2 or any(e % world for e in experts):
        raise SystemExit(f"run under torchrun with --nproc-per-node >= 2 dividing every shape's experts {experts}")
    pg = init_distributed(world, num_moe_experts=experts[0])
    try:
        rows = run(args, pg)
        if dist.get_rank() == 0:
            print_table(rows)
            if args.json:
                meta = dict(run_metadata(rank_device()), backend=dist.get_backend(), args=vars(args))
                Path(args.json).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
