"""Time the EP token exchange of one MoE layer: dispatch + combine, forward and backward, per dispatcher.

    torchrun --nproc-per-node 2 tools/bench_dispatch.py --tokens 8192 --hidden 4096 \\
        --num-experts 64 --topk 8 --json out.json

Experts are the identity (``y = x * prob``) so the time is the dispatcher's: permute, the count exchange
and its host sync, the all-to-alls (or all-gather / reduce-scatter), chunk sorting and unpermute. Uniform
random top-k routing. Timed with CUDA events after warm-up (wall clock on CPU); prints one row per
(dispatcher, pass) with the median and min over iterations, on rank 0, and writes them as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_core.config import TransformerConfig  # noqa: E402
from moe_core.moe.token_dispatcher_allgather import MoEAllGatherTokenDispatcher  # noqa: E402
from moe_core.moe.token_dispatcher_alltoall import MoEAlltoAllTokenDispatcher  # noqa: E402
from moe_core.parallel.launch import init_distributed  # noqa: E402


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start, stop) -> float:
        if self.cuda:
            stop.synchronize()
            return start.elapsed_time(stop)
        return (stop - start) * 1e3


def _bench(dispatcher, hidden, probs, routing_map, iters: int, warmup: int, timer: _Timer) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"forward": [], "backward": []}
    for i in range(warmup + iters):
        x = hidden.detach().requires_grad_()
        dist.barrier()
        t0 = timer.now()
        permuted, _, permuted_probs, meta = dispatcher.dispatch(x, probs, routing_map)
        out = dispatcher.combine(permuted * permuted_probs.unsqueeze(-1).to(permuted.dtype), meta)
        t1 = timer.now()
        out.backward(torch.ones_like(out))
        t2 = timer.now()
        if i >= warmup:
            times["forward"].append(timer.elapsed_ms(t0, t1))
            times["backward"].append(timer.elapsed_ms(t1, t2))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)

    pg = init_distributed(int(os.environ.get("WORLD_SIZE", "1")), num_moe_experts=args.num_experts)
    if pg is None:
        raise SystemExit("run under torchrun with --nproc-per-node >= 2")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
                               num_moe_experts=args.num_experts, moe_router_topk=args.topk,
                               expert_model_parallel_size=pg.ep_size)
    g = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, getattr(torch, args.dtype))
    scores = torch.rand(args.tokens, args.num_experts, generator=g).to(device)
    top = scores.topk(args.topk, dim=-1)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros_like(scores).scatter(1, top.indices, torch.softmax(top.values, -1))
    local = pg.local_expert_indices(args.num_experts)
    timer = _Timer(device)
    rows = []
    for name, cls in (("alltoall", MoEAlltoAllTokenDispatcher), ("allgather", MoEAllGatherTokenDispatcher)):
        times = _bench(cls(len(local), local, config, pg), hidden, probs, routing_map, args.iters, args.warmup, timer)
        rows += [(name, p, statistics.median(t), min(t)) for p, t in times.items()]
    if dist.get_rank() == 0:
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"# EP={pg.ep_size} tokens/rank={args.tokens} hidden={args.hidden} experts={args.num_experts} "
              f"topk={args.topk} {args.dtype} {dist.get_backend()} {gpu}")
        print(f"{'dispatcher':<10} {'pass':<9} {'median ms':>10} {'min ms':>8}")
        for name, p, med, low in rows:
            print(f"{name:<10} {p:<9} {med:>10.3f} {low:>8.3f}")
        if args.json:
            meta = dict(ep=pg.ep_size, backend=dist.get_backend(), device=gpu, **vars(args))
            Path(args.json).write_text(json.dumps(
                [dict(meta, dispatcher=name, median_ms=med, min_ms=low, **{"pass": p}) for name, p, med, low in rows],
                indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
