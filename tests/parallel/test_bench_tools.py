"""The distributed modes of the benchmark tools on two ranks (gloo on CPU; NCCL with MOE_CORE_TEST_BACKEND=nccl):
tiny shapes, complete rows, and the sanity figures they report."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests.parallel._common import groups
from tests.parallel._launch import run_distributed

TOOLS = str(Path(__file__).resolve().parents[2] / "tools")


def _tool(name: str):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    return __import__(name)


def _dispatch_rows() -> list[dict]:
    bench = _tool("bench_dispatch")
    args = bench.parse_args(["--tokens", "40", "--hidden", "32", "--num-experts", "8", "--topk", "2", "--iters", "2",
                             "--warmup", "1", "--floor-mib", "1", "--dtype", "float32"])
    return bench.run(args, groups(2, 8))


def _moe_layer_rows(flags: list[str]) -> list[dict]:
    bench = _tool("bench_moe_layer_ep")
    return bench.run(bench.parse_args(["--smoke", *flags]), groups(2, 8))


def _compiled_moe_layer_rows(flags: list[str]) -> dict:
    """The rows, and the graphs Dynamo compiled for each layer's forward: the frames it converted in all."""
    from torch._dynamo.utils import counters

    counters.clear()
    return {"rows": _moe_layer_rows(flags), "frames": counters["stats"]["unique_graphs"]}


def _pretrain_rows() -> list[dict]:
    bench = _tool("bench_pretrain")
    return bench.run(bench.parse_args(["--smoke", "--providers", "moe_core"]), groups(2, 4))


def test_bench_dispatch_times_each_dispatcher_beside_the_replay_of_its_collectives():
    ranks = run_distributed(2, _dispatch_rows, timeout=300)
    assert ranks[0] == ranks[1]  # every figure is the slowest rank's
    rows = {(r["dispatcher"], r.get("pass")): r for r in ranks[0]}
    names = ("allgather", "alltoall", "alltoall_expert_rows", "alltoall_sync_free", "alltoall_sync_free_compiled",
             "alltoall_sync_free_cuda_graph")
    assert sorted(rows, key=str) == sorted([(d, p) for d in names for p in ("forward", "backward")]
                                           + [("all_to_all_single", None)], key=str)
    for (_, phase), r in rows.items():
        keys = ("median_ms", "floor_ms", "vs_floor") if phase else ("median_ms", "busbw_gbs")
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in keys), r
    # alltoall: the count exchange, the packed rows, combine's rows; backward mirrors the last two. A token goes
    # once to each rank: fewer bytes than a row per expert.
    for name in ("alltoall", "alltoall_expert_rows"):
        assert rows[(name, "forward")]["collectives"] == ["all_to_all_single"] * 3
        assert rows[(name, "backward")]["collectives"] == ["all_to_all_single"] * 2
    assert rows[("alltoall", "forward")]["bytes_out"] < rows[("alltoall_expert_rows", "forward")]["bytes_out"]
    # Sync-free, eager or compiled whole: no count exchange, the packed rows and combine's rows each way; forward's
    # eager exchange checks the token counts first (the collectives are recorded from it; on gloo the graphed row
    # runs compiled, without graphs).
    for name in ("alltoall_sync_free", "alltoall_sync_free_compiled", "alltoall_sync_free_cuda_graph"):
        assert rows[(name, "forward")]["collectives"] == ["all_gather_into_tensor"] + ["all_to_all_single"] * 2
        assert rows[(name, "backward")]["collectives"] == ["all_to_all_single"] * 2
    # The compiled and graphed exchanges compute the eager one's outputs and gradients (float32: rounding only).
    for (name, phase), r in rows.items():
        compiled = name.endswith(("_compiled", "_cuda_graph"))
        assert phase is None or (r["max_diff_vs_eager"] is None) != compiled, r
        assert not compiled or r["max_diff_vs_eager"] <= 1e-5, r
    # allgather: the count exchange, then hidden, probs and routing map; combine's reduce-scatter.
    assert rows[("allgather", "forward")]["collectives"] == ["all_gather_into_tensor"] * 4 + ["reduce_scatter_tensor"]


def test_bench_moe_layer_ep_compares_ep_with_one_gpu_on_the_same_weights():
    rows = run_distributed(2, _moe_layer_rows, timeout=120,
                           flags=["--dispatchers", "alltoall", "allgather", "--shared-expert-size", "16"])[0]
    providers = {(r["provider"], r["dispatcher"], r["pass"]) for r in rows}
    assert providers == {(p, d, s) for p, d in [("ep1", None), ("ep", "alltoall"), ("ep_overlap", "alltoall"),
                                                ("ep", "allgather"), ("ep_overlap", "allgather")]
                         for s in ("forward", "backward")}
    for r in rows:
        assert r["median_ms"] > 0 and r["vs_ep1"] > 0
        assert r.get("max_abs_diff", 0.0) < 1e-5  # float32: EP computes the one-GPU layer's function


def test_bench_moe_layer_ep_compiles_the_sync_free_layer():
    got = run_distributed(2, _compiled_moe_layer_rows, timeout=300,
                          flags=["--moe-dispatch-sync-free", "--compile"])[0]
    rows = got["rows"]
    assert {(r["provider"], r["pass"]) for r in rows} == {(p, s) for p in ("ep1", "ep")
                                                          for s in ("forward", "backward")}
    print("frames", got["frames"])
    assert got["frames"] >= 2, got["frames"]  # each layer's forward ran compiled, the one-GPU and the EP layer
    for r in rows:
        assert r["sync_free"] and r["compiled"] and r["median_ms"] > 0
        assert r.get("max_abs_diff", 0.0) < 1e-5  # float32: the compiled EP layer computes the one-GPU function


def test_bench_pretrain_under_ep_reports_both_layouts():
    rows = run_distributed(2, _pretrain_rows, timeout=240)[0]
    assert [(r["provider"], r["ep"]) for r in rows] == [("moe_core", 2), ("moe_core", 1)]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["tokens_per_s"] > 0 and r["last_loss"] < r["first_loss"]
    assert rows[0]["vs_one_gpu"] == pytest.approx(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"])
    assert 1.0 <= rows[0]["ep_load_imbalance"] <= 2.0 and "ep_load_imbalance" not in rows[1]
