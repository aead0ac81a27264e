"""Time the EP token exchange of one MoE layer, dispatch + combine, forward and backward, per dispatcher, beside the
NCCL floor of the same bytes.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --standalone --nproc-per-node 2 tools/bench_dispatch.py --tokens 16384 --hidden 2048 \\
        --num-experts 128 --topk 8 --json $OUT/dispatch.json          # Qwen3-30B-A3B's layer at EP=2
    ... --expert scale                                               # the experts of the issue's baseline table
    nsys profile -o $OUT/dispatch --trace cuda,nvtx,osrt torchrun ... --iters 5   # NVTX ranges per phase

Dispatchers: ``alltoall`` (its default layout: token rows, a token once per EP rank), ``alltoall_expert_rows``
(``ExpertRowsAlltoAllDispatcher``: one row per (token, expert), Megatron's layout, which the all-to-all keeps for
drop_and_pad), ``allgather``; ``alltoall_sync_free`` (``SyncFreeTokenRowsAlltoAllDispatcher``, the layout of
``moe_dispatch_sync_free``: every token to every rank, expert rows sized for the worst case; eagerly, one exchange
of the token count checks that the ranks agree); ``alltoall_sync_free_compiled``, the
sync-free all-to-all with dispatch, expert and combine compiled whole (``torch.compile(fullgraph=True)``, the
all-to-alls functional collectives, as in a compiled layer; warm-up includes the compilation);
``alltoall_sync_free_cuda_graph``, the same replayed as CUDA graphs (``reduce-overhead``, as under
``enable_cuda_graph``; on CPU compiled only). Experts: ``identity`` (default), the dispatched rows go straight to
combine and the probs get a gradient of ones, so only the dispatcher is timed (its gathers, the count exchange and its
host sync, the collectives); ``scale``, ``y = x * prob`` per row, one more pass over the rows each way. Uniform random
top-k routing, bf16 rows (or --dtype).

Floor: the collectives one step of the dispatcher issues, recorded (shapes, dtypes, split sizes) and replayed alone
on preallocated buffers, forward's and backward's separately: what NCCL needs to move those bytes, with no compute.
``vs_floor`` is the dispatcher's time over it; a layout that moves fewer bytes has a lower floor, so compare
``alltoall``'s time with ``alltoall_expert_rows``' floor too (the bytes of one row per expert). Also a sweep of
``all_to_all_single`` at equal splits (--floor-mib) with the bus bandwidth.

``max_diff_vs_eager`` (compiled and graphed rows): the largest absolute difference between their outputs and input
gradients and the eager exchange's on the same inputs, the maximum over ranks; rounding only, where they compute
the same exchange.

Every timed iteration starts after a barrier; CUDA events per phase (the wall clock on CPU); each figure is the
slowest rank's median over --iters after --warmup. Prints a table on rank 0 and writes the rows as JSON (--json).
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

from _bench_common import run_metadata  # noqa: E402
from _bench_dist import all_to_all_sweep, lockstep_ms, rank_device, recording, replay, slowest_rank  # noqa: E402

from moe_core.config import TransformerConfig  # noqa: E402
from moe_core.moe.alltoall_expert_rows import ExpertRowsAlltoAllDispatcher  # noqa: E402
from moe_core.moe.alltoall_token_rows import SyncFreeTokenRowsAlltoAllDispatcher  # noqa: E402
from moe_core.moe.dispatcher_factory import EP_DISPATCHERS  # noqa: E402
from moe_core.parallel.launch import destroy_distributed, init_distributed  # noqa: E402
from moe_core.parallel.process_groups import ProcessGroupCollection  # noqa: E402

EXPERTS = ("identity", "scale")

# name: (what builds the dispatcher, torch.compile mode of the whole exchange or None: eager)
DISPATCHERS = {
    **{name: (cls, None) for name, cls in EP_DISPATCHERS.items()},
    "alltoall_expert_rows": (ExpertRowsAlltoAllDispatcher, None),
    "alltoall_sync_free": (SyncFreeTokenRowsAlltoAllDispatcher, None),
    "alltoall_sync_free_compiled": (SyncFreeTokenRowsAlltoAllDispatcher, "default"),
    "alltoall_sync_free_cuda_graph": (SyncFreeTokenRowsAlltoAllDispatcher, "reduce-overhead"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dispatchers", nargs="+", choices=sorted(DISPATCHERS), default=sorted(DISPATCHERS))
    parser.add_argument("--expert", choices=EXPERTS, default="identity",
                        help="what stands between dispatch and combine")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--floor-mib", type=int, nargs="*", default=[16, 64, 256, 512],
                        help="all_to_all_single sweep, MiB out per rank (none: skip)")
    parser.add_argument("--json", default=None, help="write the rows here (rank 0)")
    return parser.parse_args(argv)


def routing(args, device: torch.device, rank: int):
    """``(hidden [T, H], probs [T, E] float32, routing_map [T, E] bool)``: uniform random top-k, seeded by rank."""
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, getattr(torch, args.dtype))
    scores = torch.rand(args.tokens, args.num_experts, generator=g).to(device)
    top = scores.topk(args.topk, dim=-1)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros_like(scores).scatter(1, top.indices, torch.softmax(top.values, -1))
    return hidden, probs, routing_map


def exchange(dispatcher, expert: str):
    """``forward(hidden, probs, routing_map) -> (combined [T, H], permuted_probs [R])``: dispatch, the expert,
    combine."""
    def forward(x, p, routing_map):
        rows, _, row_probs, meta = dispatcher.dispatch(x, p, routing_map)
        out = dispatcher.combine(rows * row_probs.unsqueeze(-1).to(rows.dtype) if expert == "scale" else rows, meta)
        return out, row_probs

    return forward


def step_phases(forward, hidden, probs, routing_map, expert: str):
    """A generator running one ``forward`` (``exchange``'s) then one backward, yielding each phase's name."""
    nvtx = torch.cuda.nvtx if hidden.is_cuda else None
    x = hidden.detach().requires_grad_()
    p = probs.detach().requires_grad_()
    _push(nvtx, "forward")
    out, row_probs = forward(x, p, routing_map)
    _pop(nvtx)
    yield "forward"
    _push(nvtx, "backward")
    _backward(out, row_probs, expert)
    _pop(nvtx)
    yield "backward"


def _backward(out: torch.Tensor, row_probs: torch.Tensor, expert: str) -> None:
    """Backward of ``exchange``'s outputs with gradients of ones (row_probs' through out alone for ``scale``)."""
    if expert == "scale":
        out.backward(torch.ones_like(out))
    else:
        torch.autograd.backward([out, row_probs], [torch.ones_like(out), torch.ones_like(row_probs)])


def max_difference(forward, eager, hidden, probs, routing_map, expert: str) -> float:
    """The largest absolute difference between ``forward``'s outputs and input gradients and ``eager``'s, on this
    rank (collective: every rank calls it)."""
    results = []
    for fn in (eager, forward):
        x, p = hidden.detach().requires_grad_(), probs.detach().requires_grad_()
        out, row_probs = fn(x, p, routing_map)
        kept = [out.detach().clone(), row_probs.detach().clone()]  # a graph's next replay overwrites its outputs
        _backward(out, row_probs, expert)
        results.append([*kept, x.grad, p.grad])
    return max(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0 for a, b in zip(*results, strict=True))


def _push(nvtx, name: str) -> None:
    if nvtx is not None:
        nvtx.range_push(name)


def _pop(nvtx) -> None:
    if nvtx is not None:
        nvtx.range_pop()


def _compiled(forward, mode: str):
    compiled = torch.compile(forward, fullgraph=True, mode=mode)
    if mode != "reduce-overhead":
        return compiled

    def replayed(*args):
        torch.compiler.cudagraph_mark_step_begin()  # the last iteration's outputs are dead: replay over them
        return compiled(*args)

    return replayed


def bench_dispatcher(name: str, args, pg: ProcessGroupCollection, device: torch.device) -> list[dict]:
    """Rows for one dispatcher: its forward and backward beside the replay of their collectives."""
    cls, mode = DISPATCHERS[name]
    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
                               num_moe_experts=args.num_experts, moe_router_topk=args.topk,
                               expert_model_parallel_size=pg.ep_size)
    local = pg.local_expert_indices(args.num_experts)
    eager = exchange(cls(len(local), local, config, pg), args.expert)
    timed = eager if mode is None else _compiled(eager, mode)
    hidden, probs, routing_map = routing(args, device, dist.get_rank())

    def phases(forward=timed):
        return step_phases(forward, hidden, probs, routing_map, args.expert)

    # The eager pass records the collectives (a compiled one issues functional collectives, which skip dist.*).
    calls: dict[str, list] = {"forward": [], "backward": []}
    gen = phases(eager)
    for phase in ("forward", "backward"):
        with recording(calls[phase]):
            next(gen)
    times = lockstep_ms(phases, args.iters, args.warmup, device)
    diff = 0.0 if mode is None else max_difference(timed, eager, hidden, probs, routing_map, args.expert)
    floors = {}
    for phase, recorded in calls.items():
        run = replay(recorded, device)

        def floor_phases(run=run, phase=phase):
            run()
            yield phase

        floors[phase] = lockstep_ms(floor_phases, args.iters, args.warmup, device)[phase]
    rows = []
    for phase in ("forward", "backward"):
        med, low, floor, worst_diff = slowest_rank(
            [statistics.median(times[phase]), min(times[phase]), statistics.median(floors[phase]), diff], device)
        rows.append(dict(dispatcher=name, expert=args.expert, median_ms=med, min_ms=low, floor_ms=floor,
                         vs_floor=med / floor if floor else None, collectives=[c.name for c in calls[phase]],
                         bytes_out=sum(c.bytes_in for c in calls[phase]), **{"pass": phase},
                         max_diff_vs_eager=None if mode is None else worst_diff))
    # The next dispatcher starts without this one's compiled exchange and its CUDA graphs' memory.
    torch._dynamo.reset()
    return rows


def run(args, pg: ProcessGroupCollection) -> list[dict]:
    """Every row of the benchmark (collective: every rank calls it)."""
    device = rank_device()
    rows = [row for name in args.dispatchers for row in bench_dispatcher(name, args, pg, device)]
    sweep = all_to_all_sweep(args.floor_mib, args.iters, args.warmup, pg.ep_size, device)
    return rows + [dict(dispatcher="all_to_all_single", **r) for r in sweep]


def print_table(rows: list[dict], args, pg: ProcessGroupCollection, device: torch.device) -> None:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# EP={pg.ep_size} tokens/rank={args.tokens} hidden={args.hidden} experts={args.num_experts} "
          f"topk={args.topk} {args.dtype} expert={args.expert} {dist.get_backend()} {gpu}")
    print(f"{'dispatcher':<20} {'pass':<9} {'median ms':>10} {'min ms':>8} {'floor ms':>9} {'vs floor':>9} "
          f"{'MiB moved':>9}")
    for r in rows:
        if "pass" in r:
            print(f"{r['dispatcher']:<20} {r['pass']:<9} {r['median_ms']:>10.3f} {r['min_ms']:>8.3f} "
                  f"{r['floor_ms']:>9.3f} {r['vs_floor'] or 0:>9.2f} {r['bytes_out'] / 2**20:>9.1f}")
    sweep = [r for r in rows if "pass" not in r]
    if sweep:
        print(f"{'all_to_all_single MiB out per rank':<36} {'median ms':>10} {'busbw GB/s':>11}")
        for r in sweep:
            print(f"{r['mib_out_per_rank']:<36} {r['median_ms']:>10.3f} {r['busbw_gbs']:>11.1f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pg = init_distributed(int(os.environ.get("WORLD_SIZE", "1")), num_moe_experts=args.num_experts)
    if pg is None:
        raise SystemExit("run under torchrun with --nproc-per-node >= 2")
    try:
        rows = run(args, pg)
        if dist.get_rank() == 0:
            device = rank_device()
            print_table(rows, args, pg, device)
            if args.json:
                meta = dict(run_metadata(device), ep=pg.ep_size, backend=dist.get_backend(), **vars(args))
                Path(args.json).write_text(json.dumps([dict(meta, **r) for r in rows], indent=1))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
