"""The benchmark's timing order: the compared kernels must follow the same work as often as each other."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_grouped_gemm as bench  # noqa: E402


def _predecessors(plan, configs):
    """(config, config timed just before it) for every timing of the plan but the first."""
    sequence = [configs[i] for _, i in plan]
    return list(zip(sequence[1:], sequence[:-1], strict=True))


@pytest.mark.parametrize("extra", [[], [("moe_core", {"MOE_CORE_GEMM_TILE": "rows"})], [(bench.BATCHED, None)]])
def test_compared_kernels_never_follow_the_loop_and_take_every_place_alike(extra):
    configs = [(p, None) for p in bench.PROVIDERS] + extra
    compared = [c for c in configs if c[0] != "loop"]
    rounds = 2 * len(compared)  # 6 (the full benchmark's) for the three default providers
    plan = bench.timing_plan(configs, rounds, bench.PASSES)
    loop_timings = [k for k, (_, i) in enumerate(plan) if configs[i][0] == "loop"]
    assert loop_timings == list(range(len(loop_timings)))  # all before the compared kernels
    pairs = _predecessors(plan, configs)
    assert all(before[0] != "loop" for after, before in pairs if after[0] not in ("loop", "dense"))
    per_round = len(bench.PASSES) * len(compared)
    orders = [[configs[i] for _, i in plan[len(loop_timings) + r * per_round:][:len(compared)]]
              for r in range(rounds)]
    for place in range(len(compared)):
        assert sorted((order[place] for order in orders), key=str) == sorted(2 * compared, key=str)


def test_every_config_is_timed_once_per_round_and_pass():
    configs = [(p, None) for p in bench.PROVIDERS] + [("moe_core", {"MOE_CORE_GEMM_TILE": "rows"})]
    plan = bench.timing_plan(configs, 6, bench.PASSES)
    assert sorted(plan) == sorted((name, i) for name in bench.PASSES for i in range(len(configs)) for _ in range(6))


def test_skewed_shapes_are_compared_with_the_same_shape_under_uniform_counts():
    def result(t, skew, tflops):
        return dict(name=f"T{t} {skew}", k=2048, n=1536, e=128, t=t, skew=skew,
                    tflops={"moe_core": {"fwd": tflops}})

    results = [result(65536, None, 600.0), result(32768, None, 500.0), result(32768, 0.3, 400.0),
               result(16384, 0.3, 300.0)]  # the last has no uniform twin: no ratio
    assert bench.skewed_vs_uniform(results) == {"T32768 0.3": {"fwd": 0.8}}
    names = [s["name"] for s in bench.shapes(quick=True)]
    assert all(n.removesuffix(" skewed") in names for n in names if n.endswith(" skewed"))


def test_batched_provider_matches_the_per_expert_loop_and_refuses_unequal_counts():
    e, rows, k, n = 3, 4, 5, 6
    x, dy = torch.randn(e * rows, k, dtype=torch.float64), torch.randn(e * rows, n, dtype=torch.float64)
    w = torch.randn(e, k, n, dtype=torch.float64)
    counts = [rows] * e
    grads = [torch.ones(e, k, n, dtype=torch.float64) for _ in range(2)]
    batched = bench.pass_fns(bench.BATCHED, None, counts, grads[0])
    loop = bench.pass_fns("loop", None, counts, grads[1])
    torch.testing.assert_close(batched["fwd"](x, w, dy).reshape(e * rows, n), loop["fwd"](x, w, dy))
    torch.testing.assert_close(batched["dgrad"](x, w, dy).reshape(e * rows, k), loop["dgrad"](x, w, dy))
    torch.testing.assert_close(batched["wgrad"](x, w, dy), loop["wgrad"](x, w, dy))
    batched["wgrad_accum"](x, w, dy)
    loop["wgrad_accum"](x, w, dy)
    torch.testing.assert_close(grads[0], grads[1])
    with pytest.raises(ValueError, match="equal counts"):
        bench.pass_fns(bench.BATCHED, None, [4, 3, 5], grads[0])


def test_wgrad_accum_adds_each_experts_wgrad_into_main_grad_once():
    # moe_core's accumulating op (its CPU kernel here) against the loop's wgrad plus an add, from the same start;
    # the dense provider adds its one [K, N] product into expert 0's slice. fwd+bwd leaves main_grad alone.
    counts, k, n = [3, 0, 5], 4, 6
    x, dy = torch.randn(sum(counts), k), torch.randn(sum(counts), n)
    start = torch.randn(len(counts), k, n)
    grads = {p: start.clone() for p in ("moe_core", "loop", "dense")}
    fns = {p: bench.pass_fns(p, torch.tensor(counts), counts, grads[p]) for p in grads}
    for f in fns.values():
        f["wgrad_accum"](x, None, dy)
        f["fwd+bwd"](x, torch.randn(len(counts), k, n), dy)
    wgrad = torch.stack([xe.t() @ de for xe, de in zip(x.split(counts), dy.split(counts), strict=True)])
    torch.testing.assert_close(grads["loop"], start + wgrad)
    torch.testing.assert_close(grads["moe_core"], start + wgrad)
    assert torch.equal(grads["moe_core"][1], start[1])  # an empty expert's slice untouched
    torch.testing.assert_close(grads["dense"][0], start[0] + x.t() @ dy)
    assert torch.equal(grads["dense"][1:], start[1:])


def test_batched_ceiling_takes_geomeans_over_the_shapes_it_ran():
    def result(name, batched, gmm, mine):
        tflops = {"moe_core": {"fwd": mine}, "torch._grouped_mm": {"fwd": gmm}}
        if batched:
            tflops[bench.BATCHED] = {"fwd": batched}
        return dict(name=name, tflops=tflops)

    results = [result("a", 440.0, 400.0, 420.0), result("b", 600.0, 500.0, 540.0),
               result("skewed", None, 300.0, 360.0)]
    out = bench.batched_ceiling(results)
    assert out["fwd"]["shapes"] == 2
    assert out["fwd"]["vs_grouped_mm"] == pytest.approx((1.1 * 1.2) ** 0.5)
    assert out["fwd"]["moe_core_vs_batched"] == pytest.approx((420 / 440 * 540 / 600) ** 0.5)
    assert bench.batched_ceiling(results[2:]) == {}
